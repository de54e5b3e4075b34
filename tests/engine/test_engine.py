"""The request-level engine API (add_request / step / abort_request): requests added while others
run, aborted mid-way and rejected leave the others' outputs unchanged and the pool whole; the
scheduler's output is plain data from which a worker's block tables can be rebuilt."""
import pickle

import pytest

from conftest import story_openings
from pagedgen import LLM, BeamSearchParams, LLMEngine, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
SEEDED = SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    return story_openings(6, seed=7)


@pytest.fixture(scope="module")
def expected(llm, prompts):
    """Token ids of each prompt run in one generate call, greedy and seeded n=2."""
    return {(i, kind): [c.token_ids for c in out.outputs]
            for kind, sp in (("greedy", GREEDY), ("seeded", SEEDED))
            for i, out in enumerate(llm.generate(prompts, sp, use_tqdm=False))}


def _drain(engine, results):
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in results and out.finished and out.index is None
            results[out.request_id] = [c.token_ids for c in out.outputs]


def _whole(engine):
    bm = engine.block_manager
    return bm.check() == [] and bm.num_free_blocks == bm.num_blocks


def test_requests_added_while_others_run_aborted_and_rejected(llm, prompts, expected):
    engine = llm.llm_engine
    assert isinstance(engine, LLMEngine) and engine is llm.engine
    results = {}
    engine.add_request("a", prompts[0], GREEDY)
    engine.add_request("b", {"prompt": prompts[1]}, SEEDED)
    engine.add_request("doomed", prompts[2], SEEDED)
    for _ in range(3):
        assert engine.step() == []
    engine.add_request("c", llm.tokenizer(prompts[3]).input_ids, GREEDY)  # joins mid-way
    engine.add_request("d", {"prompt_token_ids": llm.tokenizer(prompts[4]).input_ids}, SEEDED)
    engine.add_request("waits", prompts[5], GREEDY)
    engine.step()
    used = engine.block_manager.num_used_blocks
    engine.abort_request(["doomed", "waits", "unknown"])  # running (forked into 2) and barely started
    assert engine.block_manager.num_used_blocks < used  # their blocks are back in the pool at once
    assert engine.get_num_unfinished_requests() == 4
    state = (engine.get_num_unfinished_requests(), engine.block_manager.num_used_blocks, len(engine.scheduler.seqs))
    bad = [
        (("e", "word " * 600, GREEDY), ValueError, r"request 'e' prompt has \d+ tokens.*max_model_len=512"),
        (("e", [1, 9999], GREEDY), ValueError, r"request 'e' prompt has token id 9999 outside the vocabulary"),
        (("e", [1, "x"], GREEDY), TypeError, r"request 'e' prompt\[1\] must be an int token id"),
        (("e", {"text": "hi"}, GREEDY), TypeError, r"request 'e' prompt must be \{'prompt'"),
        (("e", "hi", SamplingParams(logprobs=10**6)), ValueError, r"request 'e' sampling_params.logprobs must be in \[0, 512\]"),
        (("e", "hi", {"temperature": 0}), TypeError, r"request 'e' sampling_params must be a SamplingParams"),
        (("e", "hi", BeamSearchParams(beam_width=10**4, max_tokens=2)), ValueError, r"request 'e' sampling_params \(a BeamSearchParams\).beam_width must be at most max_num_seqs"),
        (("a", "hi", GREEDY), ValueError, r"request 'a' is already queued"),
        ((7, "hi", GREEDY), TypeError, "request_id must be a str"),
    ]
    for args, error, match in bad:
        with pytest.raises(error, match=match):
            engine.add_request(*args)
        assert (engine.get_num_unfinished_requests(), engine.block_manager.num_used_blocks, len(engine.scheduler.seqs)) == state
    _drain(engine, results)
    assert set(results) == {"a", "b", "c", "d"}
    assert results["a"] == expected[(0, "greedy")] and results["c"] == expected[(3, "greedy")]
    assert results["b"] == expected[(1, "seeded")] and results["d"] == expected[(4, "seeded")]
    assert _whole(engine) and engine.step() == []


def test_abort_beam_search_and_parallel_samples_mid_way(llm, prompts, expected):
    engine = llm.llm_engine
    engine.add_request("beams", prompts[0], BeamSearchParams(beam_width=3, max_tokens=12))
    engine.add_request("samples", prompts[1], SamplingParams(n=4, max_tokens=30, seed=1))
    engine.add_request("keep", prompts[2], GREEDY)
    for _ in range(4):
        engine.step()
    assert len(engine.scheduler.seqs) == 3 + 4 + 1
    engine.abort_request("beams")
    engine.abort_request("samples")
    assert len(engine.scheduler.seqs) == 1
    results = {}
    _drain(engine, results)
    assert results == {"keep": expected[(2, "greedy")]} and _whole(engine)


def test_generate_refuses_to_mix_with_engine_requests(llm, prompts, expected):
    engine = llm.llm_engine
    engine.add_request("mine", prompts[0], GREEDY)
    with pytest.raises(RuntimeError, match="1 unfinished requests added with llm_engine.add_request"):
        llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    results = {}
    _drain(engine, results)
    assert results == {"mine": expected[(0, "greedy")]}
    assert [[c.token_ids for c in o.outputs] for o in llm.generate(prompts[:1], GREEDY, use_tqdm=False)] == [expected[(0, "greedy")]]


@pytest.mark.in_process
@pytest.mark.parametrize("caching, mode", [(True, "recompute"), (False, "swap")])
def test_scheduler_output_is_plain_data_a_worker_can_apply(stories_path, prompts, caching, mode):
    """Every step's SchedulerOutput survives pickling, and applying its block-table deltas to a
    mirror gives exactly the block manager's tables; its token ids are the step's input tokens."""
    llm = LLM(stories_path, num_kv_blocks=12, max_model_len=192, enable_prefix_caching=caching, preemption_mode=mode)
    engine, mirror, seen = llm.llm_engine, {}, {"steps": 0, "preempted": 0, "cow": 0, "freed": 0}
    real = engine.model_runner.execute

    def checked(batch):
        bm = engine.block_manager
        plan = pickle.loads(pickle.dumps(batch.plan))
        plan.apply_block_tables(mirror)
        for seq, seq_id, start, n, tokens in zip(batch.seqs, plan.seq_ids, plan.num_computed_tokens, plan.num_new_tokens, plan.token_ids):
            assert seq.seq_id == seq_id and seq.num_computed_tokens == start
            assert mirror[seq_id] == bm.block_table(seq_id)
            assert tokens == seq.token_ids[start : start + n]
        seen["steps"] += 1
        seen["preempted"] += len(plan.preempted_seq_ids)
        seen["cow"] += len(plan.blocks_to_copy)
        seen["freed"] += len(plan.freed_seq_ids)
        return real(batch)

    engine.model_runner.execute = checked
    outs = llm.generate(prompts * 2, [GREEDY, SEEDED] * 6, use_tqdm=False)
    assert all(o.finished for o in outs)
    assert seen["preempted"] > 0 and seen["cow"] > 0 and seen["freed"] > 0
    assert set(mirror) == set(engine.scheduler._freed)  # the next step's output would free the rest


def test_one_sampling_params_for_many_requests_is_checked_once_and_changes_are_seen(llm):
    """add_request reuses the checked copy of an unchanged SamplingParams object (a data set through
    the engine API); a change to that object after a request is queued is checked again and does
    not reach the requests already queued."""
    engine = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("a", "Once upon a time", sp)
    engine.add_request("b", "The dog", sp)
    a, b = engine._requests["a"].params, engine._requests["b"].params
    assert a is b and a is not sp and a == sp
    sp.max_tokens = 5
    engine.add_request("c", "The cat", sp)
    c = engine._requests["c"].params
    assert c is not a and c.max_tokens == 5 and a.max_tokens == 3
    sp.temperature = -1.0
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request("d", "A bird", sp)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
    assert {k: len(o.outputs[0].token_ids) for k, o in outs.items()} == {"a": 3, "b": 3, "c": 5}
