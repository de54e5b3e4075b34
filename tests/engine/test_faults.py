"""Fault injection: an exception or a KeyboardInterrupt at each point of a step leaves the engine as
good as new. After each, the block pool is whole and the next run's outputs (token ids and
logprobs of greedy, seeded n > 1, stop-string and beam-search requests in one batch) are bitwise a
fresh LLM's, with prefix caching on and off, recompute and swap preemption (a pool small enough
that requests are preempted)."""
import pytest
import tqdm.auto

from conftest import story_openings
from pagedgen import LLM, BeamSearchParams, SamplingParams, ops
from pagedgen.engine.detokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NUM_LAYERS = 5  # stories260K
FAIL_AT_STEP = 4  # late enough that prefix-cache entries were committed and requests preempted


def _workload():
    prompts = [p + " " + p for p in story_openings(4, seed=4)]  # 2-5 full blocks: prefix-cache hits
    requests = [
        (prompts[0], SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=2)),
        (prompts[1], SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=14, ignore_eos=True, logprobs=1)),
        (prompts[2], SamplingParams(temperature=0, max_tokens=14, stop=[" he", " she"], include_stop_str_in_output=True)),
        (prompts[3], BeamSearchParams(beam_width=2, max_tokens=10)),
        (prompts[0], SamplingParams(temperature=0.8, seed=9, max_tokens=14, ignore_eos=True, logprobs=0)),
    ]
    return requests


def _key(out):
    return [(c.token_ids, c.text, c.cumulative_logprob, None if c.logprobs is None else [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs])
            for c in out.outputs]


def _run(llm):
    """The workload through the engine API, every request in one batch."""
    engine = llm.llm_engine
    for i, (prompt, params) in enumerate(_workload()):
        engine.add_request(f"r{i}", prompt, params)
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            results[out.request_id] = _key(out)
    return results


def _generate(llm, use_tqdm=True):
    """The sampling requests of the workload through LLM.generate (the progress bar is its own)."""
    reqs = [(p, sp) for p, sp in _workload() if isinstance(sp, SamplingParams)]
    return [_key(o) for o in llm.generate([p for p, _ in reqs], [sp for _, sp in reqs], use_tqdm=use_tqdm)]


CONFIGS = [dict(enable_prefix_caching=c, preemption_mode=m) for c in (True, False) for m in ("recompute", "swap")]


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda c: f"caching={c['enable_prefix_caching']}-{c['preemption_mode']}")
def setup(request, stories_path):
    """(config, the LLM that takes the faults, a fresh LLM's outputs)."""
    kwargs = dict(num_kv_blocks=10, max_model_len=160, **request.param)
    fresh = LLM(stories_path, **kwargs)
    expected = (_run(fresh), _generate(fresh, use_tqdm=False))
    assert fresh.get_stats().num_preemptions > 0, "the pool should be small enough to preempt"
    return kwargs, LLM(stories_path, **kwargs), expected


class Injected(Exception):
    pass


def _failing(real, at, kind, before=False):
    """``real`` wrapped to raise ``kind`` on its ``at``-th call (before or after doing its work)."""
    calls = {"n": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if before and calls["n"] == at:
            raise kind("injected")
        result = real(*args, **kwargs)
        if calls["n"] == at:
            raise kind("injected")
        return result

    wrapper.calls = calls
    return wrapper


def _inject(monkeypatch, llm, point, kind):
    """Arm the fault; returns the wrapper (its ``calls`` say whether it fired)."""
    engine = llm.llm_engine
    if point in ("first layer", "last layer", "sampling") and engine.model_runner is None and not hasattr(engine.executor, "worker"):
        pytest.skip("the model runs in a worker process (tests/executor/test_executor.py injects faults there)")
    if point in ("before scheduling", "after scheduling"):
        w = _failing(engine.scheduler.schedule, FAIL_AT_STEP, kind, before=point == "before scheduling")
        monkeypatch.setattr(engine.scheduler, "schedule", w)
    elif point in ("first layer", "last layer"):
        at = (FAIL_AT_STEP - 1) * NUM_LAYERS + (1 if point == "first layer" else NUM_LAYERS)
        w = _failing(ops.reshape_and_cache, at, kind)  # the layer's keys and values are written, then it fails
        monkeypatch.setattr(ops, "reshape_and_cache", w)
    elif point == "sampling":
        runner = engine.model_runner or engine.executor.worker.runner  # in process, or the pickling executor's worker
        w = _failing(runner.sampler, FAIL_AT_STEP, kind)
        monkeypatch.setattr(runner, "sampler", w)
    elif point == "detokenizer":
        w = _failing(IncrementalDetokenizer.append, 6, kind)
        monkeypatch.setattr(IncrementalDetokenizer, "append", w)
    else:  # the progress bar's update after a step
        class FailingBar(tqdm.auto.tqdm):
            def update(self, n=1):
                FailingBar.calls["n"] += 1
                if FailingBar.calls["n"] == 2:
                    raise kind("injected")
                return super().update(n)

        FailingBar.calls = {"n": 0}
        monkeypatch.setattr(tqdm.auto, "tqdm", FailingBar)
        w = FailingBar
    return w


POINTS = ["before scheduling", "after scheduling", "first layer", "last layer", "sampling", "detokenizer", "progress callback"]


@pytest.mark.parametrize("kind", [Injected, KeyboardInterrupt])
@pytest.mark.parametrize("point", POINTS)
def test_fault_leaves_no_trace(setup, monkeypatch, point, kind):
    kwargs, llm, (expected_run, expected_generate) = setup
    with monkeypatch.context() as m:
        fault = _inject(m, llm, point, kind)
        with pytest.raises(kind, match="injected"):
            if point == "progress callback":
                _generate(llm)
            else:
                _run(llm)
        assert fault.calls["n"] > 0
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    for bm in (engine.block_manager, engine.scheduler.cpu_block_manager):
        if bm is not None:
            assert bm.check() == [] and bm.num_free_blocks == bm.num_blocks
    assert _run(llm) == expected_run
    if point == "progress callback":  # the fault was in LLM.generate: check that path too
        assert _generate(llm, use_tqdm=False) == expected_generate
