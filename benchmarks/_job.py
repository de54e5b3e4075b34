"""The job and result files that every system runner of benchmarks/throughput.py reads and writes.

One runner process per (system, repeat): ``python RUNNER JOB.json RESULT.json``. The runner may live in
another virtual environment (vLLM's), so this module needs only the standard library and psutil.

Job (written by throughput.py, the same token ids and limits for every system)::

    model             checkpoint folder (Hugging Face layout)
    dtype             "float32" | "bfloat16" | "float16"
    device            "cpu" | "cuda"
    prompts           [{"prompt_token_ids": [int, ...]}, ...]   vLLM's TokensPrompt, one per request
    max_tokens        [int, ...]   per-request output tokens (exact: ignore_eos)
    ignore_eos, greedy, seed   both true: the runners implement greedy decoding with exact lengths only
    warmup_prompts    [{"prompt_token_ids": [...]}, ...]   run untimed with max_tokens 4 first
    options           system-specific settings (max_num_seqs, KV blocks, batch size, ...)

Result (written by the runner)::

    output_token_ids  [[int, ...], ...]   per request, in input order
    seconds           wall seconds of the timed generation call(s)
    computed_tokens   output tokens computed (static batching computes past a request's own limit)
    peak_rss_bytes    peak resident memory of the runner process and its children (PeakRSS)
    info              system facts for the report (versions, effective settings, statistics)
"""
from __future__ import annotations

import json
import os
import resource
import sys
import threading

import psutil


def read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def write_json(path: str, data: dict) -> None:
    """Write ``data`` to ``path`` atomically (a reader never sees half a file)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def token_ids(job: dict, key: str = "prompts") -> list[list[int]]:
    """The prompts of ``job`` as plain token-id lists."""
    return [p["prompt_token_ids"] for p in job[key]]


def check_lengths(system: str, outputs: list[list[int]], max_tokens: list[int]) -> None:
    """ignore_eos must hold in every system: each request gives exactly its max_tokens tokens."""
    bad = [i for i, (o, m) in enumerate(zip(outputs, max_tokens)) if len(o) != m]
    if bad:
        i = bad[0]
        raise RuntimeError(f"{system}: {len(bad)} requests did not produce exactly max_tokens tokens "
                           f"(request {i}: {len(outputs[i])} of {max_tokens[i]})")


class PeakRSS:
    """Peak resident set size, in bytes, of this process plus all its descendants.

    A daemon thread sums the RSS of the process tree every ``interval`` seconds (vLLM runs its
    engine core in a child process); the result is at least this process's own ``ru_maxrss``, which
    the kernel keeps exactly. Pages shared between the processes are counted once per process.
    """

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self.sampled = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "PeakRSS":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        me = psutil.Process()
        while not self._stop.is_set():
            total = 0
            for p in [me, *me.children(recursive=True)]:
                try:
                    total += p.memory_info().rss
                except psutil.Error:  # a child that just exited
                    pass
            self.sampled = max(self.sampled, total)
            self._stop.wait(self.interval)

    @property
    def peak_bytes(self) -> int:
        own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        return max(self.sampled, own)


def main(run, argv=None) -> None:
    """``RUNNER JOB.json RESULT.json``: run ``run(job) -> result dict`` under PeakRSS, write the result."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        raise SystemExit(f"usage: {os.path.basename(sys.argv[0])} JOB.json RESULT.json")
    job = read_json(argv[0])
    if not (job["greedy"] and job["ignore_eos"]):
        raise SystemExit("the runners implement greedy, ignore_eos jobs only (exact lengths, comparable outputs)")
    with PeakRSS() as rss:
        result = run(job)
    result["peak_rss_bytes"] = rss.peak_bytes
    write_json(argv[1], result)
