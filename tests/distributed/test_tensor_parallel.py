"""Tensor parallelism (``LLM(tensor_parallel_size=N)``) against TP = 1, on the CPU with gloo.

- stories260K (8 query / 4 KV heads, 5 layers, vocab 512): TP = 2 and TP = 4 give TP = 1's greedy
  tokens for 64 prompts of mixed lengths, with preemption and chunked prefill (a small cache),
  prompt logprobs within 1e-4 (fp32); seeded sampling, n > 1, prefix caching and the streaming API
  at TP = 2;
- tiny random checkpoints of every family of the registry at TP = 2 (GPT-2's Conv1D and fused
  c_attn, GPT-NeoX's interleaved q/k/v, OPT with biases and project_in/out, Phi-3's fused
  checkpoints, sliding windows, Gemma's head size; Mistral and Gemma with two KV heads);
- beam search, swap preemption, the request-level API, batch invariance and the resumable CLI
  (killed with SIGKILL, resumed) at TP = 2;
- a size that does not divide the KV heads is a ValueError before any process starts;
- faults: a rank killed mid-step, an exception in one rank, Ctrl-C in the driver mid-step.
TP = 4 runs on a 2-core machine with ``PAGEDGEN_TP_OVERSUBSCRIBE=1`` (the size is otherwise
limited to the cores).
"""
import multiprocessing
import os
import signal
import threading
import time

import pytest

from worker_rpc import fail_steps, normal_steps, slow_steps, wait_gone as _gone
from conftest import ROOT, story_openings
from pagedgen import LLM, SamplingParams

KW = dict(num_kv_blocks=24, max_model_len=192, max_num_batched_tokens=96)  # preemption and chunked prefill
GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def prompts():
    return story_openings(64, seed=5)


@pytest.fixture(scope="module")
def tp1(stories_path):
    return LLM(stories_path, **KW)


@pytest.fixture(scope="module")
def tp2(stories_path):
    llm = LLM(stories_path, tensor_parallel_size=2, **KW)
    yield llm
    llm.shutdown()


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_tp2_greedy_tokens_equal_tp1_with_preemption(tp1, tp2, prompts):
    assert len(tp2.llm_engine.executor.worker_pids) == 2
    expected = _tokens(tp1.generate(prompts, GREEDY, use_tqdm=False))
    assert _tokens(tp2.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert tp2.get_stats().num_preemptions > 0


def test_tp2_prompt_logprobs_within_1e_4(tp1, tp2, prompts):
    sp = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1, logprobs=2)
    a, b = tp1.generate(prompts[:8], sp, use_tqdm=False), tp2.generate(prompts[:8], sp, use_tqdm=False)
    worst = 0.0
    for x, y in zip(a, b):
        for px, py in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:]):
            assert px.keys() == py.keys()
            worst = max(worst, max(abs(px[t].logprob - py[t].logprob) for t in px))
    assert worst <= 1e-4, worst


def test_tp2_seeds_n_prefix_caching_and_streaming(tp1, tp2, prompts):
    sps = [SamplingParams(temperature=1.0, seed=i, n=2, max_tokens=8) for i in range(16)]
    shared = ["Once upon a time there was a little girl named Lily. " + p for p in prompts[:16]]  # cached prefixes
    assert _tokens(tp2.generate(shared, sps, use_tqdm=False)) == _tokens(tp1.generate(shared, sps, use_tqdm=False))
    streamed = {o.index: [c.token_ids for c in o.outputs] for o in tp2.generate_stream(prompts[:16], GREEDY)}
    assert [streamed[i] for i in range(16)] == _tokens(tp1.generate(prompts[:16], GREEDY, use_tqdm=False))


def test_tp2_uses_the_shared_memory_all_reduce(tp2):
    assert tp2.llm_engine.executor.communicator == "shm"


def test_tp4_greedy_tokens_equal_tp1_over_gloo(stories_path, tp1, prompts, monkeypatch):
    monkeypatch.setenv("PAGEDGEN_TP_OVERSUBSCRIBE", "1")
    monkeypatch.setenv("PAGEDGEN_TP_ALLREDUCE", "gloo")  # the fallback; TP = 2 above runs the shared-memory one
    expected = _tokens(tp1.generate(prompts, GREEDY, use_tqdm=False))
    with LLM(stories_path, tensor_parallel_size=4, **KW) as llm:
        assert llm.llm_engine.executor.communicator == "gloo"
        assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected


# every family of the registry; the ones with a single KV head get two (a size must divide the KV heads)
FAMILY_KV_HEADS = {"mistral": 2, "gemma": 2}


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gpt2", "opt", "opt-postnorm-proj",
                                    "gpt_neox", "gpt_neox-sequential"])
def test_family_tp2_equals_tp1(family, tmp_path):
    from tiny_checkpoints import build

    extra = {"num_key_value_heads": FAMILY_KV_HEADS[family]} if family in FAMILY_KV_HEADS else {}
    build(family, str(tmp_path), **extra)
    prompts = [[(7 * i + j) % 4000 + 5 for j in range(3 + 5 * i)] for i in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = _tokens(LLM(str(tmp_path), num_kv_blocks=64).generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False))
    with LLM(str(tmp_path), num_kv_blocks=64, tensor_parallel_size=2) as llm:
        assert _tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)) == expected


def test_bad_size_is_refused_before_any_process(stories_path, monkeypatch):
    monkeypatch.setenv("PAGEDGEN_TP_OVERSUBSCRIBE", "1")
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide num_attention_heads \(8\)"):
        LLM(stories_path, tensor_parallel_size=3)
    monkeypatch.delenv("PAGEDGEN_TP_OVERSUBSCRIBE")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=64 must be <= the CPU cores"):
        LLM(stories_path, tensor_parallel_size=64)
    cores = len(os.sched_getaffinity(0))
    if cores < 3:  # every problem of the size in one message: the cores and the heads
        with pytest.raises(ValueError) as info:
            LLM(stories_path, tensor_parallel_size=3)
        assert str(info.value) == (f"LLM tensor_parallel_size=3 must be <= the CPU cores this process may use ({cores}); "
                                   "tensor_parallel_size=3 must divide num_attention_heads (8) of the model; "
                                   "tensor_parallel_size=3 must divide num_key_value_heads (4) of the model")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=64 must divide num_attention_heads \(8\)"):
        LLM(stories_path, tensor_parallel_size=64)
    assert set(multiprocessing.active_children()) == before


def test_exception_in_one_rank_then_fresh_group(tp1, tp2, prompts):
    expected = _tokens(tp1.generate(prompts[:8], GREEDY, use_tqdm=False))
    executor = tp2.llm_engine.executor
    old = executor.worker_pids
    executor.collective_rpc(fail_steps, (1, "injected in rank 1"))
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"worker rank 1 raised ValueError in step \d+: injected in rank 1"):
        tp2.generate(prompts[:8], GREEDY, use_tqdm=False)
    assert time.monotonic() - started < 10.0 and _gone(old)
    assert _tokens(tp2.generate(prompts[:8], GREEDY, use_tqdm=False)) == expected  # fresh workers


def test_ctrl_c_in_the_driver_at_tp2_then_the_next_call_equals_a_fresh_llm(tp1, tp2, prompts, default_sigint):
    """SIGINT reaches the driver while both ranks run a step (they ignore it); the next call's
    outputs equal a fresh LLM's (the late replies are dropped, or the workers replaced if the
    interrupt cut a pipe read)."""
    expected = _tokens(tp1.generate(prompts, GREEDY, use_tqdm=False))
    executor = tp2.llm_engine.executor
    executor.collective_rpc(slow_steps, (0.2,))
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            tp2.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        timer.cancel()
    assert time.monotonic() - started < 5.0
    executor.collective_rpc(normal_steps)
    assert tp2.llm_engine.block_manager.num_used_blocks == 0
    assert _tokens(tp2.generate(prompts, GREEDY, use_tqdm=False)) == expected


def test_killed_rank_raises_within_10_s_and_leaves_no_process(stories_path, prompts, tp1):
    llm = LLM(stories_path, tensor_parallel_size=2, **KW)
    pids = llm.llm_engine.executor.collective_rpc(slow_steps, (0.2,))
    timer = threading.Timer(0.8, os.kill, (pids[1], signal.SIGKILL))
    timer.start()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"worker rank 1 \(pid {pids[1]}\) was killed by SIGKILL"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert time.monotonic() - started < 10.0
    timer.cancel()
    assert _gone(pids)
    assert llm.llm_engine.block_manager.num_used_blocks == 0
    # restarted for the next call, as a raising rank is: the LLM stays usable and equals TP = 1
    assert _tokens(llm.generate(prompts[:8], GREEDY, use_tqdm=False)) == _tokens(tp1.generate(prompts[:8], GREEDY, use_tqdm=False))
    assert not set(llm.llm_engine.executor.worker_pids) & set(pids)
    llm.shutdown()


def test_rank_killed_while_starting_fails_the_start_at_once(stories_path, monkeypatch):
    """Rank 1 killed while the group starts: the LLM raises naming it within seconds, and no
    worker is left (the driver used to watch rank 0 alone, which waited for rank 1 in the group's
    rendezvous, until START_TIMEOUT_S: 600 s; 30 s here so that a regression fails, not hangs)."""
    from pagedgen.executor import multiproc

    monkeypatch.setattr(multiproc, "START_TIMEOUT_S", 30.0)
    killed, before = [], {p.pid for p in multiprocessing.active_children()}  # other LLMs' workers (module fixtures)

    def kill_rank_1() -> None:
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            for proc in multiprocessing.active_children():
                if proc.name == "pagedgen-worker-1" and proc.pid and proc.pid not in before:
                    time.sleep(0.3)  # inside its start-up (imports, model, rendezvous take seconds)
                    os.kill(proc.pid, signal.SIGKILL)
                    killed.append(proc.pid)
                    return
            time.sleep(0.01)

    threading.Thread(target=kill_rank_1, daemon=True).start()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"worker rank 1 \(pid \d+\) was killed by SIGKILL during starting"):
        LLM(stories_path, tensor_parallel_size=2, **KW)
    assert time.monotonic() - started < 20.0
    assert killed and _gone(killed)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("pagedgen-worker") and p.pid not in before]


def test_shm_all_reduce_sums_in_rank_order_on_every_rank(tmp_path, monkeypatch):
    """Three ranks (threads here) reduce tensors larger than a slot: every rank gets bitwise
    s0 + s1 + s2 summed in that order, whatever the timing; all_gather is in rank order."""
    import torch

    from pagedgen.distributed import shm

    monkeypatch.setattr(shm, "CHUNK_BYTES", 4096)
    size, path = 3, str(tmp_path / "allreduce")
    data = [torch.randn(5, 700, generator=torch.Generator().manual_seed(r)) * 10 ** r for r in range(size)]
    expected = (data[0] + data[1]) + data[2]
    results, gathered = [None] * size, [None] * size

    def rank(r):
        comm = shm.ShmCommunicator(path, r, size, fallback=None)
        for _ in range(3):  # rounds reuse the two slot sets
            results[r] = comm.all_reduce(data[r].clone())
        gathered[r] = comm.all_gather(torch.full((2, 3), float(r)))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for r in range(size):
        assert torch.equal(results[r], expected)
        assert torch.equal(gathered[r], torch.cat([torch.full((2, 3), float(k)) for k in range(size)], dim=-1))


def test_tp2_beam_search_equals_tp1(tp1, tp2, prompts):
    from pagedgen import BeamSearchParams

    params = BeamSearchParams(beam_width=3, max_tokens=6)
    a = tp1.beam_search(prompts[:6], params, use_tqdm=False)
    b = tp2.beam_search(prompts[:6], params, use_tqdm=False)
    assert [[s.tokens for s in o.sequences] for o in b] == [[s.tokens for s in o.sequences] for o in a]


def test_tp2_swap_preemption_equals_tp1(stories_path, tp1, prompts):
    expected = _tokens(tp1.generate(prompts, GREEDY, use_tqdm=False))
    with LLM(stories_path, tensor_parallel_size=2, preemption_mode="swap", **KW) as llm:
        assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
        assert llm.get_stats().num_preemptions > 0


def test_tp2_request_level_api_and_batch_invariance(tp2, prompts):
    """add_request / step at TP = 2; each prompt alone gives its tokens in the full batch (a fixed
    world size keeps batch invariance)."""
    together = _tokens(tp2.generate(prompts[:8], GREEDY, use_tqdm=False))
    alone = [_tokens(tp2.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts[:8]]
    assert alone == together
    engine = tp2.llm_engine
    for i, p in enumerate(prompts[:8]):
        engine.add_request(f"r{i}", p, GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [c.token_ids for c in out.outputs]
    assert [done[f"r{i}"] for i in range(8)] == together


def test_tp2_cli_killed_and_resumed(stories_path, tmp_path, capsys):
    """The resumable CLI at --tensor-parallel-size 2: killed with SIGKILL mid-run (its workers
    follow the driver out), resumed, the same bytes as an uninterrupted TP = 1 run."""
    import json

    from cli_util import popen_cli, run_cli

    src = tmp_path / "in.jsonl"
    openings = story_openings(300, seed=9)
    src.write_text("".join(json.dumps({"id": f"r{i}", "prompt": p}) + "\n" for i, p in enumerate(openings)))
    args = ("--temperature", "0", "--max-tokens", 6, "--flush-rows", 10, "--flush-seconds", 0.05)
    ref, out = tmp_path / "ref.jsonl", tmp_path / "out.jsonl"
    rc, err = run_cli(capsys, "--model", stories_path, "--input", src, "--output", ref, *args)
    assert rc == 0, err
    proc = popen_cli("--model", stories_path, "--input", src, "--output", out, "--tensor-parallel-size", 2, *args)
    end = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < end and (not out.exists() or out.read_bytes().count(b"\n") < 40):
        time.sleep(0.01)
    children = _children(proc.pid)
    proc.kill()
    proc.wait(timeout=60)  # not communicate(): the workers hold the stderr pipe until they are gone
    proc.stderr.close()
    assert ref.read_bytes().startswith(out.read_bytes()[: out.read_bytes().rfind(b"\n") + 1])
    assert _gone(children, 30.0), "workers outlived their killed driver"  # (30 s: a loaded machine)
    rc, err = run_cli(capsys, "--model", stories_path, "--input", src, "--output", out, "--tensor-parallel-size", 2, *args)
    assert rc == 0, err
    assert out.read_bytes() == ref.read_bytes()


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []




DRIVER_DIES_MID_STEP = """
import os, sys
sys.path.insert(0, {root!r})
from pagedgen import LLM
from pagedgen.executor.messages import RunOnWorker
from test_tensor_parallel import all_reduce_once

if __name__ == "__main__":
    llm = LLM({model!r}, tensor_parallel_size=2, num_kv_blocks=24, max_model_len=192)
    ex = llm.llm_engine.executor
    print(" ".join(map(str, ex.worker_pids)), flush=True)
    ex._conns[0].send(RunOnWorker(10**6, all_reduce_once))  # rank 0 alone: it waits for rank 1 in the all-reduce
    import time
    time.sleep(1.0)
    os._exit(0)  # the driver dies without a word (as under SIGKILL)
"""


def all_reduce_once(worker):
    import torch

    return worker.tp.comm.all_reduce(torch.ones(4)).tolist()


def test_workers_end_with_their_driver_even_inside_a_collective(stories_path, tmp_path):
    """A driver killed between sending a step to rank 0 and to rank 1 leaves rank 0 waiting in the
    all-reduce for a rank that never got the step: it ends anyway (the driver watch), and the group's
    folder in /dev/shm goes with it."""
    import subprocess
    import sys

    script = tmp_path / "driver.py"
    here = os.path.dirname(os.path.abspath(__file__))
    script.write_text(DRIVER_DIES_MID_STEP.format(root=here, model=stories_path))
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, here, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "support")]))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    pids = [int(p) for p in proc.stdout.split()]
    assert _gone(pids, 30.0), "a worker outlived its driver"
    if os.path.isdir("/dev/shm"):
        assert not [d for d in set(os.listdir("/dev/shm")) - before if d.startswith("pagedgen-tp-")]
