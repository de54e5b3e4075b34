"""Pipeline parallelism (``LLM(pipeline_parallel_size=P)``, alone and with ``tensor_parallel_size``)
against one rank, on the CPU.

- stories260K (5 layers, split 3 + 2 as vLLM does; 8 query / 4 KV heads) at PP = 2 and TP 2 x PP 2:
  greedy tokens identical to TP = PP = 1 for 64 prompts of mixed lengths, with recompute
  preemption and chunked prefill (a small cache); prompt logprobs within 1e-4 at TP 2 x PP 2 and
  bitwise equal at PP = 2 (stages split no sum, and the micro-batches are batch-invariant); seeds,
  n > 1, beam search and prefix caching; test_executor's mix of requests (structured outputs,
  penalties, logprobs); swap preemption over the gloo activation channel;
- tiny random GPT-2 (its head tied to an embedding that lives on the other stage), OPT with
  project_in/out and Qwen2 (per-layer sliding windows, numbered globally on each stage) at PP = 2:
  tokens and logprobs bitwise PP = 1's (every family was checked once the same way);
- the micro-batch split and merge without a model;
- sizes refused before any process starts; faults: a pipeline rank killed mid-step, an exception
  in one stage, Ctrl-C in the driver.
Four ranks on a 2-core machine need ``PAGEDGEN_TP_OVERSUBSCRIBE=1`` (set here for TP 2 x PP 2).
"""
import multiprocessing
import os
import signal
import threading
import time

import pytest
from conftest import story_openings
from worker_rpc import fail_steps, normal_steps, slow_steps
from worker_rpc import wait_gone as _gone

from pagedgen import LLM, SamplingParams
from pagedgen.beam_search import BeamSearchParams

KW = dict(num_kv_blocks=24, max_model_len=192, max_num_batched_tokens=96)  # preemption and chunked prefill
GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def prompts():
    return story_openings(64, seed=5)


@pytest.fixture(scope="module")
def ref(stories_path):
    return LLM(stories_path, **KW)


@pytest.fixture(scope="module")
def expected(ref, prompts):
    return _tokens(ref.generate(prompts, GREEDY, use_tqdm=False))


@pytest.fixture(scope="module")
def pp2(stories_path):
    llm = LLM(stories_path, pipeline_parallel_size=2, **KW)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def tp2pp2(stories_path):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDGEN_TP_OVERSUBSCRIBE", "1")
        llm = LLM(stories_path, tensor_parallel_size=2, pipeline_parallel_size=2, **KW)
    yield llm
    llm.shutdown()


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def _prompt_logprobs(outs):
    return [o.prompt_logprobs[1:] for o in outs]


def _count_microbatches(worker) -> None:
    """Count the rank's steps and the micro-batches it prepares (module level: pickled by name)."""
    runner, counts = worker.runner, {"steps": 0, "microbatches": 0}
    worker.counts = counts
    real_execute, real_prepare = runner.execute, runner.prepare

    def execute(batch):
        counts["steps"] += 1
        return real_execute(batch)

    def prepare(batch):
        counts["microbatches"] += 1
        return real_prepare(batch)

    runner.execute, runner.prepare = execute, prepare


def _counts(worker) -> dict:
    runner = worker.runner
    runner.__dict__.pop("execute", None), runner.__dict__.pop("prepare", None)
    return worker.counts


def test_pp2_greedy_tokens_equal_one_rank_with_preemption(pp2, prompts, expected):
    executor = pp2.llm_engine.executor
    assert len(executor.worker_pids) == 2 and executor.output_rank == 1
    assert executor.transfer == "shm"
    executor.collective_rpc(_count_microbatches)
    assert _tokens(pp2.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert pp2.get_stats().num_preemptions > 0
    first, last = executor.collective_rpc(_counts)
    assert first == last and first["microbatches"] > 1.5 * first["steps"]  # most steps ran as two micro-batches


def test_tp2_pp2_greedy_tokens_equal_one_rank_with_preemption(tp2pp2, prompts, expected):
    executor = tp2pp2.llm_engine.executor
    assert len(executor.worker_pids) == 4 and executor.output_rank == 2
    assert (executor.communicator, executor.transfer) == ("shm", "shm")
    assert _tokens(tp2pp2.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert tp2pp2.get_stats().num_preemptions > 0


def _worst_logprob_gap(a, b) -> float:
    worst = 0.0
    for x, y in zip(_prompt_logprobs(a), _prompt_logprobs(b)):
        for px, py in zip(x, y):
            assert px.keys() == py.keys()
            worst = max(worst, max(abs(px[t].logprob - py[t].logprob) for t in px))
    return worst


def test_pp2_logprobs_are_bitwise_one_rank_s(ref, pp2, prompts):
    """A stage split adds no reduction and the micro-batches are batch-invariant: bit for bit."""
    sp = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1, logprobs=2)
    a, b = ref.generate(prompts[:16], sp, use_tqdm=False), pp2.generate(prompts[:16], sp, use_tqdm=False)
    assert _prompt_logprobs(a) == _prompt_logprobs(b)
    assert [[c.logprobs for c in o.outputs] for o in a] == [[c.logprobs for c in o.outputs] for o in b]


def test_tp2_pp2_prompt_logprobs_within_1e_4(ref, tp2pp2, prompts):
    sp = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1, logprobs=2)
    a, b = ref.generate(prompts[:8], sp, use_tqdm=False), tp2pp2.generate(prompts[:8], sp, use_tqdm=False)
    assert _worst_logprob_gap(a, b) <= 1e-4


@pytest.mark.parametrize("name", ["pp2", "tp2pp2"])
def test_seeds_n_beams_and_prefix_caching(name, request, ref, prompts):
    llm = request.getfixturevalue(name)
    sps = [SamplingParams(temperature=1.0, seed=i, n=2, max_tokens=8) for i in range(12)]
    shared = ["Once upon a time there was a little girl named Lily. " + p for p in prompts[:12]]  # cached prefixes
    cached = llm.get_stats().num_cached_tokens
    assert _tokens(llm.generate(shared, sps, use_tqdm=False)) == _tokens(ref.generate(shared, sps, use_tqdm=False))
    assert llm.get_stats().num_cached_tokens > cached
    beams = BeamSearchParams(beam_width=3, max_tokens=6)
    assert [[s.tokens for s in b.sequences] for b in llm.beam_search(prompts[:3], beams)] == [
        [s.tokens for s in b.sequences] for b in ref.beam_search(prompts[:3], beams)]


def test_swap_preemption_over_the_gloo_channel(stories_path, prompts, expected, monkeypatch):
    monkeypatch.setenv("PAGEDGEN_PP_TRANSFER", "gloo")  # the fallback; the fixtures above use shared memory
    with LLM(stories_path, pipeline_parallel_size=2, preemption_mode="swap", **KW) as llm:
        assert llm.llm_engine.executor.transfer == "gloo"
        assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
        assert llm.get_stats().num_preemptions > 0


@pytest.mark.parametrize("family", ["gpt2", "opt-postnorm-proj", "qwen2"])
def test_family_pp2_equals_one_rank(family, tmp_path):
    from tiny_checkpoints import build

    build(family, str(tmp_path))
    prompts = [{"prompt_token_ids": [(7 * i + j) % 4000 + 5 for j in range(3 + 5 * i)]} for i in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    a = LLM(str(tmp_path), num_kv_blocks=64).generate(prompts, sp, use_tqdm=False)
    with LLM(str(tmp_path), num_kv_blocks=64, pipeline_parallel_size=2) as llm:
        b = llm.generate(prompts, sp, use_tqdm=False)
    assert [[(c.token_ids, c.logprobs) for c in o.outputs] for o in b] == [[(c.token_ids, c.logprobs) for c in o.outputs] for o in a]


def _stage(worker):
    """(layers, KV caches, top-level modules with parameters, layer indices with parameters)."""
    names = [n for n, _ in worker.runner.model.named_parameters()]
    return (worker.pp.start, worker.pp.end, len(worker.runner.kv_caches), sorted({".".join(n.split(".")[:2]) for n in names}),
            sorted({int(n.split(".")[2]) for n in names if ".layers." in n}))


def test_stages_hold_only_their_layers_and_kv_cache(pp2):
    first, last = pp2.llm_engine.executor.collective_rpc(_stage)
    assert first == (0, 3, 3, ["model.embed_tokens", "model.layers"], [0, 1, 2])
    assert last == (3, 5, 2, ["lm_head.weight", "model.layers", "model.norm"], [3, 4])


def test_microbatches_split_balanced_keep_forks_and_merge_in_step_order():
    from types import SimpleNamespace

    from pagedgen.core.scheduler_output import ScheduledBatch, SchedulerOutput
    from pagedgen.worker import microbatch
    from pagedgen.worker.model_runner import StepOutput

    seqs = [SimpleNamespace(seq_id=i) for i in range(5)]
    child = SimpleNamespace(seq_id=9)
    plan = SchedulerOutput(seq_ids=[0, 1, 2, 3, 4], num_new_tokens=[40, 1, 1, 30, 8], num_computed_tokens=[0, 5, 6, 0, 0],
                           token_ids=[[1] * 40, [2], [3], [4] * 30, [5] * 8], block_table_updates={3: (0, [7, 8])},
                           freed_seq_ids=[6], forked=[(9, 3)])
    batch = ScheduledBatch(plan, seqs, [(child, seqs[3])])
    a, b = microbatch.split(batch, 2)
    assert a.plan.seq_ids == [0] and b.plan.seq_ids == [1, 2, 3, 4]  # 40 and 40 tokens
    assert a.plan.block_table_updates == {3: (0, [7, 8])} and a.plan.freed_seq_ids == [6]  # the first carries the step's deltas
    assert b.plan.block_table_updates == {} and b.plan.freed_seq_ids == []
    assert b.plan.forked == [(9, 3)] and b.forked == [(child, seqs[3])] and a.forked == []
    assert microbatch.split(batch, 1) == [batch]
    assert [mb.plan.seq_ids for mb in microbatch.split(batch, 8)] == [[0], [1], [2], [3], [4]]
    out_a = StepOutput([seqs[0]], [10], None)
    out_b = StepOutput([seqs[1], seqs[3], seqs[4], child], [11, 13, 14, 19], [None, {13: 0.0}, None, None])
    merged = microbatch.merge(batch, [out_b, out_a])
    assert [s.seq_id for s in merged.seqs] == [0, 1, 3, 4, 9] and merged.token_ids == [10, 11, 13, 14, 19]
    assert merged.logprobs == [None, None, {13: 0.0}, None, None]


def test_bad_sizes_are_refused_before_any_process(stories_path, monkeypatch):
    monkeypatch.setenv("PAGEDGEN_TP_OVERSUBSCRIBE", "1")
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=6 must be <= num_hidden_layers \(5\)"):
        LLM(stories_path, pipeline_parallel_size=6)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide num_attention_heads \(8\)"):
        LLM(stories_path, tensor_parallel_size=3, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        LLM(stories_path, pipeline_parallel_size=0)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=2 = 2 ranks needs distributed_executor_backend='mp'"):
        LLM(stories_path, pipeline_parallel_size=2, distributed_executor_backend="pickle")
    monkeypatch.delenv("PAGEDGEN_TP_OVERSUBSCRIBE")
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match=rf"tensor_parallel_size=2 x pipeline_parallel_size={cores} = {2 * cores} ranks must be <= the CPU cores this process may use \({cores}\)"):
        LLM(stories_path, tensor_parallel_size=2, pipeline_parallel_size=cores)
    assert set(multiprocessing.active_children()) == before


# functions run in the workers through collective_rpc (module level: pickled by name)
def test_ctrl_c_in_the_driver_then_the_next_call_equals_a_fresh_llm(pp2, prompts, expected, default_sigint):
    executor = pp2.llm_engine.executor
    executor.collective_rpc(slow_steps, (0.2,))
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            pp2.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        timer.cancel()
    assert time.monotonic() - started < 5.0
    executor.collective_rpc(normal_steps)
    assert _tokens(pp2.generate(prompts, GREEDY, use_tqdm=False)) == expected


def test_exception_in_one_stage_then_fresh_workers(pp2, prompts, expected):
    executor = pp2.llm_engine.executor
    old = executor.worker_pids
    executor.collective_rpc(fail_steps, (0, "injected in stage 0"))  # rank 0: stage 0 at TP = 1
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"worker rank 0 raised ValueError in step \d+: injected in stage 0"):
        pp2.generate(prompts[:8], GREEDY, use_tqdm=False)
    assert time.monotonic() - started < 10.0 and _gone(old)
    assert _tokens(pp2.generate(prompts, GREEDY, use_tqdm=False)) == expected  # fresh workers
    assert pp2.llm_engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("victim", [0, 1])
def test_killed_stage_raises_within_10_s_and_leaves_no_process(stories_path, prompts, victim):
    llm = LLM(stories_path, pipeline_parallel_size=2, **KW)
    pids = llm.llm_engine.executor.collective_rpc(slow_steps, (0.2,))
    timer = threading.Timer(0.8, os.kill, (pids[victim], signal.SIGKILL))
    timer.start()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"worker rank {victim} \(pid {pids[victim]}\) was killed by SIGKILL"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert time.monotonic() - started < 10.0
    timer.cancel()
    assert _gone(pids)
    assert llm.llm_engine.block_manager.num_used_blocks == 0


def test_the_flag_reaches_the_cli_lm_eval_and_ray_through_engine_args(stories_path):
    from pagedgen.cli.args import build_parser
    from pagedgen.engine_args import EngineArgs

    ns = build_parser().parse_args(["--model", stories_path, "--input", "in.jsonl", "--output", "out.jsonl", "--pipeline-parallel-size", "2", "--tensor-parallel-size", "2"])
    args = EngineArgs.from_cli_args(ns)
    assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (2, 2)
    # lm_eval's model_args and Ray's llm_kwargs go through EngineArgs.from_dict (strings converted)
    assert EngineArgs.from_dict({"model": stories_path, "pipeline_parallel_size": "2"}).pipeline_parallel_size == 2
    assert "pipeline stages" in EngineArgs.__dataclass_fields__["pipeline_parallel_size"].metadata["help"]


def test_shm_channel_hands_on_tensors_bitwise_two_messages_ahead_at_most(tmp_path):
    """A sender (thread) and a receiver over one shared file: every message comes out bitwise, in
    order, with its dtypes and shapes; the sender never gets more than two messages ahead."""
    import torch

    from pagedgen.distributed.p2p import ShmChannel

    path = str(tmp_path / "p2p-0-1")
    messages = [
        (torch.randn(7, 64, generator=torch.Generator().manual_seed(i)), torch.randn(7, 64).to(torch.bfloat16))
        if i % 2 else (torch.randn(3 + i, 5, generator=torch.Generator().manual_seed(i)),)
        for i in range(9)
    ]
    sender, receiver = ShmChannel(path, peer=1), ShmChannel(path, peer=0)
    sent = []

    def send_all():
        for i, m in enumerate(messages):
            sender.send(m)
            sent.append(i)

    thread = threading.Thread(target=send_all)
    thread.start()
    time.sleep(0.3)
    assert len(sent) == 2  # both slots full, nothing read yet
    got = []
    for _ in messages:
        got.append(receiver.recv())
    thread.join(10)
    assert len(got) == len(messages)
    for m, g in zip(messages, got):
        assert len(m) == len(g) and all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(m, g))


def test_mixed_requests_equal_one_rank(pp2, ref):
    """test_executor's mix at PP = 2: penalties, top-p, logprobs, prompt logprobs with min_tokens,
    n = 3, and a grammar bitmask that reaches only the micro-batches holding its sequences."""
    from worker_rpc import run_mixed as _run

    prompts = story_openings(10, seed=2)
    assert _run(pp2, prompts) == _run(ref, prompts)
