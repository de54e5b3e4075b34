"""benchmarks/throughput.py --dry-run: arguments, prompts and plan, no generation (a few seconds each)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "throughput.py")
SHARED = os.path.join(os.path.dirname(ROOT), "shared")  # where the script looks (or .gpu_assets/)
STORIES = os.path.join(SHARED, "models", "stories260K")
GPT2_TOKENIZER = os.path.join(SHARED, "models", "gpt2-tokenizer")
TINYSTORIES = os.path.join(SHARED, "data", "tinystories_valid_first1000", "tinystories_valid_first1000.jsonl")


def dry_run(*args: str) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, SCRIPT, "--dry-run", *args], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "dry run: nothing generated" in proc.stdout
    return proc.stdout


@pytest.mark.parametrize(
    "args, needs, expect",
    [
        ((), (STORIES, TINYSTORIES), "workload tinystories: 1000 requests"),
        (("--model", "random-135m", "--num-prompts", "64"), (GPT2_TOKENIZER, TINYSTORIES), "random-135m (bfloat16, max_model_len 2048)"),
    ],
    ids=["stories260K", "random-135m"],
)
def test_dry_run(args, needs, expect):
    for path in needs:
        if not os.path.exists(path):
            pytest.skip(f"{path} not found")
    out = dry_run(*args)
    assert expect in out
    assert "max_tokens    min/mean/max" in out


def test_bad_systems_is_a_usage_error():
    proc = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--systems", "pagedgen,vllm"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--systems" in proc.stderr


def test_help_lists_device():
    """scripts/gpu_check.sh runs the end-to-end stage only when --help lists --device."""
    proc = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--device" in proc.stdout
