"""The CPU-side parts of the GPU run (scripts/gpu_check.sh, benchmarks/kernels.py): argument checks,
the printed plans, the preparation step. Fast; no GPU needed."""
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*cmd, env=None):
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})})


def test_kernels_benchmark_dry_run_prints_the_cases(tmp_path):
    r = run(sys.executable, "benchmarks/kernels.py", "--dry-run", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    for batch in (1, 64, 256):
        for context in (512, 2048, 8192, 32768):
            assert any(line.split()[:2] == [str(batch), str(context)] for line in r.stdout.splitlines())
    assert str(tmp_path) in r.stdout
    assert not os.listdir(tmp_path), "a dry run writes nothing"


def test_kernels_benchmark_quick_and_out_default(tmp_path):
    r = run(sys.executable, "benchmarks/kernels.py", "--dry-run", "--quick", env={"OUT": str(tmp_path / "o")})
    assert r.returncode == 0, r.stderr
    rows = [line.split()[:2] for line in r.stdout.splitlines() if line.split()[:1] in (["1"], ["64"])]
    assert rows == [["1", "512"], ["1", "8192"], ["64", "512"], ["64", "8192"]]
    assert str(tmp_path / "o") in r.stdout


def test_kernels_benchmark_runs_decode_and_prefill_cases_on_the_cpu(tmp_path):
    # the GPU run's code path (cases, timing, SDPA with the causal masks, the tables) on tiny sizes
    from pagedgen import ops

    if not ops.extension_available("cpu"):
        pytest.skip(f"pagedgen._C CPU kernels unavailable: {ops.extension_error('cpu')}")
    r = run(sys.executable, "benchmarks/kernels.py", "--device", "cpu", "--dtype", "float32", "--batch", "2",
            "--context", "40", "--num-heads", "4", "--num-kv-heads", "2", "--head-size", "16", "--block-size", "8",
            "--prefill-chunk", "8", "24", "--prefill-prefix", "0", "13", "--repeat", "2", "--warmup", "1",
            "--prefill-repeat", "2", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    result = json.loads((tmp_path / "kernels.json").read_text())
    assert [(c["batch"], c["context"]) for c in result["cases"]] == [(2, 40)]
    assert [(c["chunk"], c["prefix"]) for c in result["prefill_cases"]] == [(8, 0), (8, 13), (24, 0), (24, 13)]
    for case in result["cases"] + result["prefill_cases"]:
        assert case["paged_ms"] > 0 and case["sdpa_ms"] > 0
        assert case["max_abs_diff"] < 1e-4, case  # the paged kernel and SDPA's causal masks agree
    assert result["prefill_cases"][1]["flops"] == 4 * 4 * 16 * (8 * 13 + 8 * 9 // 2)
    table = (tmp_path / "kernels.txt").read_text()
    assert "prefill attention" in table and len(table.splitlines()) == 3 + 1 + 2 + 4


@pytest.mark.parametrize("bad", [["--num-heads", "30"], ["--batch", "0"], ["--dtype", "int8"], ["--prefill-chunk", "0"],
                                 ["--prefill-prefix", "-1"], ["--device", "tpu"]])
def test_kernels_benchmark_rejects_bad_arguments(bad):
    r = run(sys.executable, "benchmarks/kernels.py", "--dry-run", *bad)
    assert r.returncode == 2 and "error" in r.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_check_dry_run_lists_the_stages(tmp_path):
    r = run("bash", "scripts/gpu_check.sh", "--dry-run", env={"OUT": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    for stage in ("env", "build", "tests", "kernels", "end-to-end"):
        assert any(line.split()[:1] == [stage] for line in r.stdout.splitlines()), stage
    for text in ("build_ext --inplace", "tests/test_ops_cuda.py", "benchmarks/kernels.py", "--device cuda", "sharegpt"):
        assert text in r.stdout
    assert not os.listdir(tmp_path), "a dry run writes nothing"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_check_prepare_copies_the_sharegpt_lengths(tmp_path):
    shared = tmp_path / "shared"
    src = shared / "data" / "sharegpt_lengths_sarathi" / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"
    src.parent.mkdir(parents=True)
    src.write_text("num_prefill_tokens,num_decode_tokens\n12,34\n")
    prompts = shared / "data" / "sharegpt_prompts_mlenergy" / "ShareGPT_V3_filtered_1000.json"
    prompts.parent.mkdir(parents=True)
    prompts.write_text("[]")
    tokenizer = shared / "models" / "gpt2-tokenizer"
    tokenizer.mkdir(parents=True)
    (tokenizer / "tokenizer.json").write_text("{}")
    # a copy of the script in a scratch checkout, so the real .gpu_assets/ stays untouched
    (tmp_path / "repo" / "scripts").mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "scripts", "gpu_check.sh"), tmp_path / "repo" / "scripts")
    r = subprocess.run(["bash", "scripts/gpu_check.sh", "--prepare"], cwd=tmp_path / "repo", capture_output=True,
                       text=True, timeout=60, env={**os.environ, "PAGEDGEN_SHARED": str(shared)})
    assert r.returncode == 0, r.stderr
    assets = tmp_path / "repo" / ".gpu_assets"
    assert (assets / "sharegpt_lengths.csv").read_text() == src.read_text()
    assert (assets / "sharegpt_prompts.json").read_text() == "[]"
    assert (assets / "gpt2-tokenizer" / "tokenizer.json").read_text() == "{}"
    assert "optional" in r.stdout and not (assets / "stories260K").exists()  # optional ones absent: skipped
    r = subprocess.run(["bash", "scripts/gpu_check.sh", "--prepare"], cwd=tmp_path / "repo", capture_output=True,
                       text=True, timeout=60, env={**os.environ, "PAGEDGEN_SHARED": str(shared)})
    assert r.returncode == 0 and (assets / "gpt2-tokenizer" / "tokenizer.json").exists(), "a second prepare replaces"
    r = subprocess.run(["bash", "scripts/gpu_check.sh", "--prepare"], cwd=tmp_path / "repo", capture_output=True,
                       text=True, timeout=60, env={**os.environ, "PAGEDGEN_SHARED": str(tmp_path / "nowhere")})
    assert r.returncode != 0 and "not found" in r.stderr


CRASHING_TESTS = '''
import ctypes
import os


def test_first():
    pass


def test_segfault():
    ctypes.string_at(0)  # SIGSEGV: kills the pytest process, as the H200 run of 2026-12-04 saw


def test_fails():
    assert os.sep == "no such separator"


def test_after_the_crash():
    pass


def test_aborts():
    os.abort()
'''


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_check_tests_stage_names_each_crash_and_runs_the_rest(tmp_path):
    test_file = tmp_path / "test_crashing.py"
    test_file.write_text(CRASHING_TESTS)
    out = tmp_path / "out"
    r = subprocess.run(["bash", "scripts/gpu_check.sh", "--tests", str(test_file)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "OUT": str(out), "PYTHON": sys.executable})
    assert r.returncode == 1, (r.stdout, r.stderr)
    outcomes = {}
    for line in (out / "tests.txt").read_text().splitlines():
        outcome, test_id = line.split(" ", 1)
        outcomes[test_id.rsplit("::", 1)[1]] = outcome
    assert outcomes == {"test_first": "passed", "test_segfault": "CRASHED", "test_fails": "failed",
                        "test_after_the_crash": "passed", "test_aborts": "CRASHED"}
    log = (out / "gpu_check.log").read_text()
    assert "2 passed, 1 failed, 0 skipped, 2 crashed" in log
    crash_lines = [line for line in log.splitlines() if line.startswith("[tests] CRASHED ")]
    assert [line.rsplit("::", 1)[1] for line in crash_lines] == ["test_segfault", "test_aborts"]
