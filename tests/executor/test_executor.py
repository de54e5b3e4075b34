"""The driver/worker boundary and the worker process's life cycle.

- the pickling executor and the worker process give the in-process engine's outputs (greedy,
  seeded, n > 1, beams, logprobs, prompt logprobs, preemption); the whole engine suites run
  through the pickled boundary with ``pytest --executor-backend=pickle``;
- faults: a worker killed mid-step or one that raises makes the call raise RuntimeError naming
  the rank within 10 s, and leaves no process behind; Ctrl-C in the driver stops the step and the
  next call equals a fresh LLM's;
- life cycle: ``shutdown()``, ``with LLM(...)`` and garbage collection end the worker.
"""
import gc
import os
import signal
import threading
import time

import pytest

from worker_rpc import MIXED, alive as _alive, normal_steps, run_mixed as _run, slow_steps, wait_gone as _wait_gone
from conftest import ROOT, story_openings
from pagedgen import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16)
KW = dict(num_kv_blocks=16, max_model_len=192, max_num_batched_tokens=64)  # preemption and chunked prefill


# functions run in the worker through collective_rpc (module level: pickled by name)
def _fail_next_step(worker) -> None:
    model = worker.runner.model

    def failing(*args, **kwargs):
        model.__dict__.pop("forward", None)
        raise ValueError("injected in the worker")

    model.forward = failing


@pytest.fixture(scope="module")
def prompts():
    return story_openings(8, seed=2)


@pytest.fixture(scope="module")
def expected(stories_path, prompts):
    return _run(LLM(stories_path, distributed_executor_backend=None, **KW), prompts)


@pytest.fixture(scope="module")
def mp_llm(stories_path):
    llm = LLM(stories_path, distributed_executor_backend="mp", **KW)
    yield llm
    llm.shutdown()


def test_pickling_executor_equals_in_process(stories_path, prompts, expected):
    llm = LLM(stories_path, distributed_executor_backend="pickle", **KW)
    assert llm.llm_engine.model_runner is None and llm.model is None
    assert _run(llm, prompts) == expected
    assert llm.get_stats().num_preemptions > 0


def test_worker_process_equals_in_process(mp_llm, prompts, expected):
    assert mp_llm.model is None and mp_llm.llm_engine.model_runner is None
    pids = mp_llm.llm_engine.executor.worker_pids
    assert len(pids) == 1 and pids[0] != os.getpid() and _alive(pids[0])
    assert _run(mp_llm, prompts) == expected


def test_exception_in_the_worker_names_the_rank_and_rolls_back(mp_llm, prompts, expected):
    mp_llm.llm_engine.executor.collective_rpc(_fail_next_step)
    with pytest.raises(RuntimeError, match=r"worker rank 0 raised ValueError in step \d+: injected in the worker"):
        mp_llm.generate(prompts, GREEDY, use_tqdm=False)
    assert mp_llm.llm_engine.block_manager.num_used_blocks == 0
    assert _run(mp_llm, prompts) == expected  # the worker stays up; the next call is a fresh engine's


def test_ctrl_c_in_the_driver_stops_the_step(mp_llm, prompts, expected, default_sigint):
    executor = mp_llm.llm_engine.executor
    executor.collective_rpc(slow_steps, (0.3,))
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            mp_llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        timer.cancel()
    assert time.monotonic() - started < 5.0
    executor.collective_rpc(normal_steps)  # its reply comes after the interrupted step's, which is dropped
    assert all(_alive(p) for p in executor.worker_pids)  # SIGINT is the driver's: the worker ignores it
    assert _run(mp_llm, prompts) == expected


def test_killed_worker_raises_within_10_s_and_leaves_no_process(stories_path, prompts, expected):
    llm = LLM(stories_path, distributed_executor_backend="mp", **KW)
    executor = llm.llm_engine.executor
    (pid,) = executor.collective_rpc(slow_steps, (0.2,))
    timer = threading.Timer(0.8, os.kill, (pid, signal.SIGKILL))
    timer.start()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"worker rank 0 \(pid {pid}\) was killed by SIGKILL during step \d+"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert time.monotonic() - started < 10.0
    timer.cancel()
    assert _wait_gone([pid])
    assert llm.llm_engine.block_manager.num_used_blocks == 0
    assert _run(llm, prompts) == expected  # restarted for the next call, as a raising rank is
    (new_pid,) = executor.worker_pids
    assert new_pid != pid and _alive(new_pid)
    llm.shutdown()


def test_worker_killed_between_calls(stories_path, prompts, expected):
    llm = LLM(stories_path, distributed_executor_backend="mp", **KW)
    (pid,) = llm.llm_engine.executor.worker_pids
    os.kill(pid, signal.SIGKILL)
    assert _wait_gone([pid])
    with pytest.raises(RuntimeError, match=rf"worker rank 0 \(pid {pid}\).*\(the next call starts fresh ones\)"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert _run(llm, prompts) == expected
    llm.shutdown()


def test_shutdown_with_and_garbage_collection_end_the_worker(stories_path, prompts):
    llm = LLM(stories_path, distributed_executor_backend="mp", **KW)
    pids = llm.llm_engine.executor.worker_pids
    llm.shutdown()
    assert _wait_gone(pids)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match="shut down"):  # refused, not queued for workers that are gone
        llm.llm_engine.add_request("late", prompts[0], GREEDY)
    assert not llm.llm_engine.has_unfinished_requests()
    for call in (lambda: llm.generate(prompts, GREEDY, use_tqdm=False), lambda: list(llm.generate_stream(prompts, GREEDY))):
        with pytest.raises(RuntimeError, match="shut down"):  # not "finish the requests added with add_request"
            call()
    llm.shutdown()  # idempotent

    with LLM(stories_path, distributed_executor_backend="mp", **KW) as llm:
        pids = llm.llm_engine.executor.worker_pids
        assert llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0].finished
    assert _wait_gone(pids)

    llm = LLM(stories_path, distributed_executor_backend="mp", **KW)
    pids = llm.llm_engine.executor.worker_pids
    del llm
    gc.collect()
    assert _wait_gone(pids)


def test_a_script_without_a_main_guard_is_told_why_its_worker_died(stories_path, tmp_path):
    """A script that makes an "mp" LLM at its top level: each spawned worker runs it again as it
    starts and dies before it can report; the driver's error says what to do."""
    import subprocess
    import sys

    script = tmp_path / "no_guard.py"
    script.write_text(f"from pagedgen import LLM\nLLM({stories_path!r}, distributed_executor_backend='mp')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: pagedgen worker rank 0") and 'if __name__ == "__main__":' in last, done.stderr[-2000:]


def test_sizes_and_backends_not_built_are_refused_before_any_process(stories_path):
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs distributed_executor_backend='mp'"):
        LLM(stories_path, tensor_parallel_size=2, distributed_executor_backend="pickle")
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 = 2 ranks needs distributed_executor_backend='mp'"):
        LLM(stories_path, pipeline_parallel_size=2, distributed_executor_backend="pickle")
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of"):
        LLM(stories_path, distributed_executor_backend="ray")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(stories_path, tensor_parallel_size=0)


def test_records_carry_each_sequence_once_then_deltas(stories_path, prompts):
    """A sequence travels whole once (again only after its table was freed: preempted), and a
    decode step carries no new sequences but the parallel samples forked in an earlier step (sent
    for their fork step only)."""
    llm = LLM(stories_path, distributed_executor_backend="pickle", **KW)
    worker = llm.llm_engine.executor.worker
    real, records = worker.execute, []

    def recording(record):
        records.append(record)
        return real(record)

    worker.execute = recording
    llm.generate(prompts, [MIXED[i % len(MIXED)] for i in range(len(prompts))], use_tqdm=False)
    sent, freed, forked = {}, set(), set()
    for record in records:
        freed.update(record.plan.freed_seq_ids)
        for new in record.new_seqs:
            assert new.seq_id not in sent or new.seq_id in freed, f"sequence {new.seq_id} sent twice without being freed"
            sent[new.seq_id] = record.step_id
            freed.discard(new.seq_id)
        if sum(record.plan.num_new_tokens) == len(record.plan.seq_ids) and not record.plan.freed_seq_ids:
            assert {new.seq_id for new in record.new_seqs} <= forked  # deltas only, but first steps of forks
        forked.update(new.seq_id for new in record.forked)
    assert len(sent) >= len(prompts) and forked and llm.get_stats().num_preemptions > 0


def _unpicklable(worker):
    return lambda: None


def test_a_reply_that_does_not_pickle_is_an_error_not_a_dead_worker(mp_llm, prompts, expected):
    with pytest.raises(RuntimeError, match="worker rank 0 raised .* the reply could not be sent"):
        mp_llm.llm_engine.executor.collective_rpc(_unpicklable)
    assert _run(mp_llm, prompts) == expected
