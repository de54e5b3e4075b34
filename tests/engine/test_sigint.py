"""A real SIGINT at a random moment of ``generate`` (it can land between any two bytecodes, inside
the scheduler or the block manager too) leaves the LLM as good as new: after each interrupt the
block pool is whole and the next call's outputs are bitwise a fresh LLM's."""
import json
import os
import subprocess
import sys

from conftest import ROOT

CHILD = r"""
import json, os, random, signal, sys, threading, time
sys.path.insert(0, sys.argv[2])
import torch
torch.set_num_threads(1)
from conftest import story_openings
from pagedgen import LLM, SamplingParams

# A process started in the background by a shell without job control inherits SIGINT ignored, and
# Python then installs no KeyboardInterrupt handler: install it, as an interactive session has it.
signal.signal(signal.SIGINT, signal.default_int_handler)

prompts = [p + " " + p for p in story_openings(8, seed=6)]
params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1),
          SamplingParams(n=2, temperature=1.0, seed=8, max_tokens=24, ignore_eos=True, logprobs=1)] * 4

def key(outs):
    return [[(c.token_ids, [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs]) for c in o.outputs] for o in outs]

def attempts(mode, seed, count, report):
    kwargs = dict(num_kv_blocks=16, max_model_len=256, preemption_mode=mode)  # small: preemption in every run
    expected = key(LLM(sys.argv[1], **kwargs).generate(prompts, params, use_tqdm=False))
    llm = LLM(sys.argv[1], **kwargs)
    start = time.perf_counter()
    assert key(llm.generate(prompts, params, use_tqdm=False)) == expected  # warm, and the length of a call
    duration = time.perf_counter() - start
    rng = random.Random(seed)
    for attempt in range(count):
        check(llm, expected, rng.uniform(0.0, duration), f"{mode} {attempt}", report)

def check(llm, expected, delay, name, report):
    timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
    try:
        try:
            timer.start()
            llm.generate(prompts, params, use_tqdm=False)
        finally:
            timer.cancel()
            timer.join()
        time.sleep(0.01)  # a signal sent just as generate returned is raised here, not later
    except KeyboardInterrupt:
        report["interrupted"] += 1
    engine = llm.llm_engine
    pools = [p for p in (engine.block_manager, engine.scheduler.cpu_block_manager) if p is not None]
    whole = all(p.check() == [] and p.num_free_blocks == p.num_blocks for p in pools) and not engine.has_unfinished_requests()
    same = key(llm.generate(prompts, params, use_tqdm=False)) == expected
    if whole and same:
        report["ok"] += 1
    else:
        report["bad"].append({"attempt": name, "whole": whole, "same": same})

report = {"interrupted": 0, "ok": 0, "bad": []}
attempts("recompute", 1, int(sys.argv[3]), report)
attempts("swap", 2, int(sys.argv[3]), report)
print(json.dumps(report))
"""


def test_real_sigint_at_random_moments(stories_path):
    tests = os.path.join(ROOT, "tests")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(tests) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    attempts = 6  # per preemption mode
    proc = subprocess.run([sys.executable, "-c", CHILD, stories_path, tests, str(attempts)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["bad"] == [] and report["ok"] == 2 * attempts, report
    assert report["interrupted"] >= attempts, f"most signals should land inside generate: {report}"
