"""The CPU-side parts of the GPU run (scripts/gpu_check.sh, benchmarks/kernels.py, benchmarks/gpu_profile.py,
throughput.py's --time-limit and generate_batch set-up): argument checks, the printed plans and caps, the
preparation step, the trace analysis. Fast; no GPU needed."""
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile

import pytest

from conftest import ROOT


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


STAGES = ("env", "build", "tests", "kernels", "profile", "end-to-end")  # in the order they run


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_check_dry_run_lists_the_stages_and_their_caps(tmp_path):
    r = run("bash", "scripts/gpu_check.sh", "--dry-run", env={"OUT": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    caps = {}
    for line in r.stdout.splitlines():
        m = re.match(r"  (\S+)\s+<=\s+(\d+)s", line)
        if m:
            caps[m.group(1)] = int(m.group(2))
    assert list(caps) == [*STAGES, "total"]  # tests and kernels before the profile and the end-to-end run
    assert caps["total"] == sum(caps[s] for s in STAGES) <= 540, caps  # one device call of at most 9 minutes
    assert caps["end-to-end"] >= 250, "the 2026-12-04 run took 244 s for pagedgen + static alone (model build included)"
    e2e = next(line for line in r.stdout.splitlines() if line.startswith("  end-to-end"))
    for text in ("benchmarks/throughput.py", "--model random-1b", "--dtype bfloat16", "--device cuda", "--workload sharegpt",
                 "--num-prompts 512", "--systems pagedgen,static,generate_batch", "--static-batch-sizes 256", "--time-limit"):
        assert text in e2e, text
    profile = next(line for line in r.stdout.splitlines() if line.startswith("  profile"))
    assert "benchmarks/gpu_profile.py" in profile and "--num-prompts 512" in profile and "--device cuda" in profile
    for text in ("build_ext --inplace", "TORCH_CUDA_ARCH_LIST=9.0", "tests/ops/test_ops_cuda.py", "benchmarks/kernels.py",
                 "gpu_check.tar.gz", "summary.txt"):
        assert text in r.stdout
    assert "$PYTHON" not in r.stdout
    assert not os.listdir(tmp_path), "a dry run writes nothing"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_check_full_run_leaves_an_archive_and_a_summary(tmp_path):
    # every stage on a stand-in python that fails at once: the orchestration (each stage runs,
    # failures are reported, the results come back as exactly two files) in a scratch checkout
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "scripts", "gpu_check.sh"), repo / "scripts")
    stub = tmp_path / "python"
    stub.write_text("#!/usr/bin/env bash\necho \"stand-in python $*\"\nexit 3\n")
    stub.chmod(0o755)
    out = tmp_path / "out"
    r = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=repo, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OUT": str(out), "PYTHON": str(stub)})
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert sorted(os.listdir(out)) == ["gpu_check.tar.gz", "summary.txt"]
    summary = (out / "summary.txt").read_text().splitlines()
    assert [line.split()[0] for line in summary[1:]] == list(STAGES)
    assert all("FAILED" in line for line in summary[1:] if line.split()[0] not in ("env",))
    last_limit = int(re.search(r"of (\d+)\)", summary[-1]).group(1))
    assert last_limit > 500, summary[-1]  # the end-to-end stage gets the seconds the others left unused
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        names = {os.path.normpath(n) for n in tar.getnames()}
    assert {"gpu_check.log", "tests.txt", "model_build.log"} <= names
    log = (repo / ".gpu_check" / "gpu_check.log").read_text()
    assert "stand-in python benchmarks/kernels.py" in log and "run_profile" in log and ".gpu_assets/" in log
    assert "stand-in python -c import sys; sys.path.insert(0, 'benchmarks'); import _workload" in (
        repo / ".gpu_check" / "model_build.log").read_text()


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


def bench(name: str):
    """A module of benchmarks/ (they import each other by plain name)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import importlib

    return importlib.import_module(name)


def x(cat, name, ts, dur, tid=1):
    return dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, tid=tid)


def test_gpu_profile_analysis_of_a_known_cuda_trace():
    gp = bench("gpu_profile")
    events = [
        x("user_annotation", gp.STEP, 0, 100), x("user_annotation", gp.STEP, 100, 100),
        x("gpu_user_annotation", gp.STEP, 0, 250, tid=7),  # the GPU-side copy of the range: not work
        x("cpu_op", "aten::copy_", 65, 20),
        x("kernel", "A", 10, 20, tid=7), x("kernel", "B", 20, 30, tid=7), x("gpu_memcpy", "Memcpy HtoD", 60, 10, tid=7),
        x("kernel", "A", 120, 20, tid=7), x("kernel", "C", 190, 50, tid=7),  # C ends after the last step's host range
        x("kernel", "early", -50, 20, tid=7),  # before the first profiled step: left out
        dict(ph="i", cat="cpu_instant_event", name="ignored", ts=5),
    ]
    a = gp.analyze(events, "cuda")
    # busy: [10, 50) + [60, 70) + [120, 140) + [190, 240) = 120 us of a 240 us window
    assert a["window_ms"] == pytest.approx(0.240) and a["busy_ms"] == pytest.approx(0.120) and a["busy_share"] == pytest.approx(0.5)
    assert [(s["wall_ms"], s["busy_ms"], s["host_ms"]) for s in a["steps"]] == [
        pytest.approx((0.100, 0.050, 0.100)), pytest.approx((0.140, 0.070, 0.100))]
    assert [(k["name"], k["calls"]) for k in a["top"]] == [("C", 1), ("A", 2), ("B", 1), ("Memcpy HtoD", 1)]
    assert a["top"][0]["share"] == pytest.approx(50 / 130) and a["num_kernels"] == 5
    g = a["gaps"]  # idle: [0, 10), [50, 60), [70, 120), [140, 190)
    assert (g["count"], g["over_10us"], g["over_100us"], g["over_1000us"]) == (4, 2, 0, 0)
    assert g["idle_ms"] + a["busy_ms"] == pytest.approx(a["window_ms"])
    assert [(y["at_ms"], y["ms"]) for y in g["largest"][:2]] == [pytest.approx((0.070, 0.050)), pytest.approx((0.140, 0.050))]
    assert g["largest"][0]["host_op"] == "aten::copy_"  # the innermost host op running as the gap began
    assert g["largest"][1]["host_op"] == f"{gp.STEP} (Python between torch ops)"
    text = gp.describe(dict(model="m", dtype="bfloat16", device_name="GPU", workload="sharegpt", num_prompts=2, skipped_steps=3,
                            skip_reason="no request waiting", step_tokens=[dict(rows=2, prefill=0)] * 2,
                            decode=dict(steps=2, wall_ms_median=0.12, busy_share_median=0.5), analysis=a))
    assert "device idle: 4 gaps" in text and "aten::copy_" in text and len(text.splitlines()) == 2 + 2 + 2 + 4 + 1 + len(g["largest"])


def test_gpu_profile_analysis_on_the_cpu_counts_nested_ops_once():
    gp = bench("gpu_profile")
    events = [x("user_annotation", gp.STEP, 0, 100), x("cpu_op", "aten::linear", 0, 50), x("cpu_op", "aten::mm", 10, 20),
              x("cpu_op", "aten::add", 60, 10)]
    a = gp.analyze(events, "cpu")
    assert a["busy_ms"] == pytest.approx(0.060) and [k["name"] for k in a["top"]] == ["aten::linear", "aten::add"]
    with pytest.raises(ValueError, match="pagedgen.step"):
        gp.analyze([x("cpu_op", "aten::add", 0, 10)], "cpu")


STORIES = os.path.join(ROOT, "..", "shared", "models", "stories260K")


@pytest.mark.skipif(not os.path.isdir(STORIES), reason="needs ../shared/models/stories260K")
def test_gpu_profile_runs_on_the_cpu(tmp_path):
    # the GPU stage's code path on a tiny model, the CPU activity only
    r = subprocess.run([sys.executable, "benchmarks/gpu_profile.py", "--model", STORIES, "--device", "cpu", "--workload",
                        "tinystories", "--num-prompts", "12", "--max-tokens", "16", "--steps", "2", "--out", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_profile.json").read_text())
    a = result["analysis"]
    assert len(a["steps"]) == 2 and len(result["step_tokens"]) == 2 and result["skip_reason"].startswith("no request waiting")
    assert all(k["prefill"] == 0 and 1 <= k["rows"] <= 12 for k in result["step_tokens"])  # every request admitted: decode steps
    assert 0 < a["busy_share"] <= 1 and a["gaps"]["idle_ms"] + a["busy_ms"] == pytest.approx(a["window_ms"])
    assert sum(s["wall_ms"] for s in a["steps"]) == pytest.approx(a["window_ms"])
    assert any(k["name"].startswith(("aten::", "pagedgen::")) for k in a["top"])
    assert result["decode"]["steps"] == 2 and "device idle:" in (tmp_path / "gpu_profile.txt").read_text()


@pytest.mark.parametrize("bad", [["--steps", "0"], ["--num-prompts", "0"], ["--max-skip", "-1"], ["--device", "tpu"]])
def test_gpu_profile_rejects_bad_arguments(bad):
    r = run(sys.executable, "benchmarks/gpu_profile.py", *bad)
    assert r.returncode == 2 and "error" in r.stderr


def test_generate_batch_config_names_the_page_size_as_the_installed_transformers_does(monkeypatch):
    import dataclasses

    import transformers

    ls = bench("_local_systems")
    opts = dict(block_size=16, num_kv_blocks=24576, max_num_seqs=256, max_num_batched_tokens=4096)

    @dataclasses.dataclass
    class Old:  # transformers 5.17 (the H200 machine's): the page size is called block_size
        block_size: int = 256
        num_blocks: int | None = None
        max_batch_tokens: int | None = None
        max_requests_per_batch: int | None = None

    monkeypatch.setattr(transformers, "ContinuousBatchingConfig", Old)
    assert ls.cb_config(opts) == Old(block_size=16, num_blocks=24576, max_batch_tokens=4096, max_requests_per_batch=256)

    @dataclasses.dataclass
    class New(Old):  # newer ones: page_size
        page_size: int = 256

    monkeypatch.setattr(transformers, "ContinuousBatchingConfig", New)
    assert ls.cb_config(opts).page_size == 16


def test_throughput_time_limit_kills_a_runner_and_keeps_going(tmp_path, monkeypatch):
    launch, tp = bench("_launch"), bench("throughput")
    monkeypatch.setattr(launch, "command", lambda system, venv: [sys.executable, "-c", "import time; time.sleep(60)"])
    with pytest.raises(RuntimeError, match="timed out after 1 s"):
        launch.run_job("generate_batch", dict(model="m"), str(tmp_path), "slow", "", {}, timeout=1)
    assert tp.job_timeout(None, 5.0) is None and tp.job_timeout(100.0, 50.0) == 100.0 - tp.REPORT_RESERVE_S - 50.0
    r = run(sys.executable, "benchmarks/throughput.py", "--dry-run", "--time-limit", "0")
    assert r.returncode == 2 and "--time-limit" in r.stderr


def test_throughput_rows_after_the_time_limit_are_reported_not_run(monkeypatch):
    import time
    import types

    tp = bench("throughput")
    calls = []

    def fake_run_job(system, job, workdir, tag, venv, env, timeout=None):
        calls.append((system, timeout))
        if system == "static":  # runs past its share of the limit
            time.sleep(max(0.0, timeout) + 0.2)
            raise RuntimeError(f"static failed (timed out after {timeout:.0f} s, killed); the end of the log:\n...")
        return dict(seconds=1.0, peak_rss_bytes=1 << 30)

    monkeypatch.setattr(tp._launch, "run_job", fake_run_job)
    args = types.SimpleNamespace(repeats=1, vllm_venv="", time_limit=30.0)
    su = types.SimpleNamespace(rows={"pagedgen": ("pagedgen", {}), "static, batch 256": ("static", {}),
                                     "generate_batch": ("generate_batch", {})}, max_tokens=[100] * 10, vllm_env={})
    lines = []
    runs, failed = tp.run_all(args, su, {}, "", lines.append, deadline=time.monotonic() + tp.REPORT_RESERVE_S + 1.4)
    assert list(runs) == ["pagedgen"], lines
    assert [c[0] for c in calls] == ["pagedgen", "static"]
    assert re.fullmatch(r"timed out after 1 s \(--time-limit\): under [\d,]+ tok/s, model load included", failed["static, batch 256"])
    assert failed["generate_batch"] == "not run: --time-limit 30 s used up"
