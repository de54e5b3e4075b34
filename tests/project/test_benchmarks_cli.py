"""benchmarks/throughput.py: dry runs (plan only), the vLLM peer without its venv, a tiny pagedgen run,
and the roofline and agreement arithmetic. No vLLM needed; a few seconds each."""
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT
BENCH = os.path.join(ROOT, "benchmarks")
SCRIPT = os.path.join(BENCH, "throughput.py")
SHARED = os.path.join(os.path.dirname(ROOT), "shared")  # where the script looks (or .gpu_assets/)
STORIES = os.path.join(SHARED, "models", "stories260K")
GPT2_TOKENIZER = os.path.join(SHARED, "models", "gpt2-tokenizer")
TINYSTORIES = os.path.join(SHARED, "data", "tinystories_valid_first1000", "tinystories_valid_first1000.jsonl")
SHAREGPT = os.path.join(SHARED, "data", "sharegpt_prompts_mlenergy", "ShareGPT_V3_filtered_1000.json")


def load(name: str):
    """A benchmarks/ helper module, imported from its file (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def need(*paths: str) -> None:
    for path in paths:
        if not os.path.exists(path):
            pytest.skip(f"{path} not found")


def run(*args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ if env is None else env, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, env=env, timeout=timeout)


def dry_run(*args: str, env: dict | None = None) -> str:
    proc = run("--dry-run", *args, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert "dry run: nothing generated" in proc.stdout
    return proc.stdout


@pytest.mark.parametrize(
    "args, needs, expect",
    [
        ((), (STORIES, TINYSTORIES), "workload tinystories: 256 requests"),
        (("--model", "random-135m", "--num-prompts", "64"), (GPT2_TOKENIZER, TINYSTORIES), "random-135m (bfloat16, max_model_len 2048)"),
        # the issue-9 ShareGPT workload: 128 first turns cut to 1,024 GPT-2 tokens, output lengths cut to 512
        (("--model", "random-135m", "--workload", "sharegpt"), (GPT2_TOKENIZER, SHAREGPT), "total 24,437"),
        (("--batch-invariant", "off"), (STORIES, TINYSTORIES), "pagedgen batch-invariant off"),
    ],
    ids=["stories260K", "random-135m", "sharegpt", "batch-invariant-off"],
)
def test_dry_run(args, needs, expect):
    need(*needs)
    out = dry_run(*args)
    assert expect in out
    assert "max_tokens    min/mean/max" in out
    assert "roofline: FLOPs = 2*W*(P + D) + 2*W_head*O" in out
    assert "machine: " in out and "avx512_bf16" in out
    if "sharegpt" in args:
        assert "128 requests" in out and "total 52,729" in out


def test_vllm_dry_run_without_venv_says_how_to_make_it(tmp_path):
    need(STORIES, TINYSTORIES)
    missing = str(tmp_path / "no-venv")
    out = dry_run("--systems", "pagedgen,vllm", "--num-prompts", "8", "--vllm-venv", missing)
    assert f"vLLM's virtual environment {missing} does not exist" in out
    assert "bash benchmarks/setup_vllm.sh" in out


def test_vllm_run_without_venv_is_a_clear_error(tmp_path):
    need(GPT2_TOKENIZER, TINYSTORIES)
    proc = run("--systems", "pagedgen,vllm", "--model", "random-135m", "--num-prompts", "2", "--vllm-venv", str(tmp_path / "none"))
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "bash benchmarks/setup_vllm.sh" in proc.stderr
    assert "run 1/1" not in proc.stdout  # nothing ran (and no model was built)


def test_vllm_dry_run_with_venv_prints_the_command(tmp_path):
    need(STORIES, TINYSTORIES)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    site = venv / "lib" / "python3.11" / "site-packages" / "vllm"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("")
    # found through the environment variable that setup_vllm.sh reads too
    out = dry_run("--systems", "vllm,pagedgen", "--num-prompts", "8", "--vllm-kv-cache-gib", "2",
                  env=dict(os.environ, PAGEDGEN_VLLM_VENV=str(venv)))
    assert "cannot run" not in out
    line = next(l for l in out.splitlines() if l.strip().startswith("vllm:"))
    assert "VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-" in line
    assert f"{venv}/bin/python" in line and "vllm_runner.py" in line
    assert "systems: vllm, pagedgen" in out


def test_bad_systems_is_a_usage_error():
    proc = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--systems", "pagedgen,tgi"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--systems" in proc.stderr
    proc = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--systems", "vllm", "--device", "cuda"], capture_output=True, text=True)
    assert proc.returncode == 2 and "CPU backend" in proc.stderr


def test_help_lists_device():
    """scripts/gpu_check.sh runs the end-to-end stage only when --help lists --device."""
    proc = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--device" in proc.stdout


def test_quick_run_pagedgen_row(tmp_path):
    """A tiny real run: the pagedgen row with tokens/s, peak RSS and roofline share, the profile
    breakdown (--profile), and the JSON."""
    need(STORIES, TINYSTORIES)
    proc = run("--quick", "--systems", "pagedgen", "--profile", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    row = next(l for l in proc.stdout.splitlines() if l.startswith("pagedgen ") and "GiB" in l)
    assert "roofline for this workload:" in proc.stdout and "torch.mm" in proc.stdout and "machine load before" in proc.stdout
    data = json.loads((tmp_path / "throughput.json").read_text())
    s = data["summary"]
    assert s["tokens_per_s"]["pagedgen"] > 0 and s["peak_rss_gib"]["pagedgen"] > 0.05
    if data["roofline"]["trusted"]:  # a quiet machine: the share
        assert "%" in row and s["roofline_share"]["pagedgen"] > 0 and not data["roofline"]["problems"]
    else:  # a busy one (as the shared test machine often is): why, and no share
        assert "roofline NOT TRUSTWORTHY" in proc.stdout and data["roofline"]["problems"]
        assert s["roofline_share"]["pagedgen"] is None and "%" not in row
    assert data["roofline"]["tokens_per_s"] > 0 and data["failed"] == {}
    (result,) = data["runs"]["pagedgen"]
    assert result["computed_tokens"] == data["workload"]["O"] and result["peak_rss_bytes"] > 0
    line = re.search(r"roofline matmul path: (.*)", proc.stdout).group(1)  # fp32: F.linear, oneDNN and panels where they run
    cases = re.findall(r"(F\.linear|oneDNN prepacked(?: bf16)?|pagedgen panels) for (\d+) of (\d+) \(shape, rows\) cases", line)
    assert cases and sum(int(n) for _, n, _ in cases) == int(cases[0][2]), line
    assert set(data["roofline"]["best_path"].values()) <= {"F.linear", "oneDNN prepacked", "pagedgen panels"}
    # the profile: components whose shares add up, the forward's parts inside it, top operators
    assert "profile of pagedgen" in proc.stdout and "paged_attention" in proc.stdout
    rows = {r["component"].strip(): r for r in data["profile"]["components"]}
    top = [r for r in data["profile"]["components"] if not r["component"].startswith(" ")]
    assert sum(r["seconds"] for r in top[:-1]) == pytest.approx(rows["total (CPU seconds, one thread)"]["seconds"])
    parts = [r["seconds"] for r in data["profile"]["components"] if r["component"].startswith("  ")]
    assert sum(parts) == pytest.approx(rows["forward"]["seconds"]) and min(parts[:-1]) >= 0
    assert rows["forward"]["share"] > 0.1 and rows["layer matmuls (linear)"]["seconds"] > 0 and rows["lm_head"]["seconds"] > 0
    assert any(o["op"] == "pagedgen::paged_attention" for o in data["profile"]["ops"])


STORIES_CFG = dict(hidden_size=64, num_hidden_layers=5, num_attention_heads=8, num_key_value_heads=4, head_dim=8,
                   intermediate_size=172, vocab_size=512)


def test_roofline_arithmetic_on_a_known_shape():
    roof = load("_roofline")
    shapes = roof.gemm_shapes(STORIES_CFG)
    assert [(s["names"], s["n"], s["k"], s["count"]) for s in shapes] == [
        (["qkv_proj"], 128, 64, 5), (["o_proj"], 64, 64, 5), (["gate_up_proj"], 344, 64, 5), (["down_proj"], 64, 172, 5),
        (["lm_head"], 512, 64, 1)]
    w, w_head = roof.weights_per_row(shapes)
    assert (w, w_head) == (226_560, 32_768)
    assert w + w_head + (2 * 5 + 1) * 64 == 260_032  # stories260K's parameter count (tied embeddings, norms)
    rows = roof.workload_rows([3, 5], [2, 4])
    assert rows == dict(P=8, D=4, O=6)
    assert roof.workload_flops(shapes, rows) == 2 * 226_560 * 12 + 2 * 32_768 * 6
    # prefill GEMMs at 2 GFLOP/s (M = 8 rows), decode GEMMs and the lm_head at 1 GFLOP/s (M = 2 rows)
    m_prefill, m_decode = roof.gemm_rows(max_num_seqs=256, num_requests=2, step_budget=4096, prompt_tokens=8)
    assert (m_prefill, m_decode) == (8, 2)
    flops = {(s["n"], s["k"], m_prefill): 2e9 for s in shapes} | {(s["n"], s["k"], m_decode): 1e9 for s in shapes}
    seconds = 2 * 226_560 * 8 / 2e9 + 2 * 226_560 * 4 / 1e9 + 2 * 32_768 * 6 / 1e9
    assert roof.roofline_tokens_per_s(shapes, rows, flops, m_prefill, m_decode) == pytest.approx(6 / seconds, rel=1e-12)


def test_roofline_shapes_of_the_random_models():
    roof, workload = load("_roofline"), load("_workload")
    w, w_head = roof.weights_per_row(roof.gemm_shapes(workload.RANDOM_MODELS["random-135m"]))
    assert w + w_head + 61 * 576 == 134_515_008  # SmolLM-135M (tied embeddings, 61 norms)
    shapes = roof.gemm_shapes(workload.RANDOM_MODELS["random-1b"])
    assert [(s["n"], s["k"]) for s in shapes] == [(2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632), (32000, 2048)]


def test_agreement_and_first_divergence():
    rep = load("_report")
    agr = rep.agreement([[1, 2, 3], [4, 5, 6], [7, 8, 9], [1]], [[1, 2, 3], [4, 0, 6], [0, 8, 9], [1]])
    assert agr == dict(identical=2, requests=4, first_divergence=[0, 1])
    line = rep.describe_agreement("pagedgen", "vllm", agr)
    assert "2/4 requests (50.0%)" in line and "min/median/max 0/0.5/1" in line
    assert rep.first_divergence([1, 2], [1, 2, 3]) == 2


def test_fold_ids_keeps_lengths():
    workload = load("_workload")
    prompts, folded = workload.fold_ids([[1, 49152, 50256], [7]], 49152)
    assert prompts == [[1, 0, 1104], [7]] and folded == 2


def test_roofline_takes_the_best_matmul_path():
    """bf16 is measured on every path an engine can take (F.linear, fp32 weights, oneDNN on
    prepacked fp32 weights where this CPU has it, and on prepacked bf16 weights where its oneDNN
    has bf16), pagedgen's panels where its kernel is built, and each shape's roofline figure is the
    fastest, named; fp32 has F.linear, the panels and oneDNN's."""
    roof = load("_roofline")
    shapes = roof.gemm_shapes(STORIES_CFG)
    import torch

    from pagedgen import ops
    from pagedgen.layers.matmul import native_reduced_precision, onednn_prepack_supported

    panels = ["pagedgen panels"] if ops.has_kernel("packed_linear") else []
    pairs = ["pagedgen bf16 pairs"] if ops.has_kernel("packed_linear_bf16") else []
    onednn = ["oneDNN prepacked"] if onednn_prepack_supported() else []
    bf16_packed = ["oneDNN prepacked bf16"] if onednn and native_reduced_precision(torch.bfloat16) else []
    assert roof.matmul_paths("bfloat16") == ["F.linear", "fp32 weights"] + panels + pairs + onednn + bf16_packed
    assert roof.matmul_paths("float32") == ["F.linear"] + panels + onednn
    assert roof.matmul_paths("float16") == ["F.linear", "fp32 weights"] + panels + onednn
    assert roof.matmul_paths("float32", "cuda") == ["F.linear"]
    flops = roof.measure(shapes, 16, 4, "bfloat16", runs=1, min_seconds=0.001, budget_seconds=0.05)
    assert set(flops["by_path"]) == {"F.linear", "fp32 weights", *panels, *pairs, *onednn, *bf16_packed} and flops["mm"][1] > 0
    assert len(flops["linear"]) == 2 * 4 + 1  # 4 layer shapes at M = 16 and 4, the lm_head at M = 4
    for key, best in flops["linear"].items():
        rates = {p: t[key] for p, t in flops["by_path"].items()}
        assert best == max(rates.values()) and rates[flops["best_path"][key]] == best


def test_batch_profile_roofline():
    """Ideal continuous batching of a workload: decode steps per batch size, Σ M·steps = D; GEMM
    times interpolate between the measured sizes; with every step at the full batch the batch-profile
    roofline equals the full-batch one."""
    roof = load("_roofline")
    # max_tokens 3, 5, 2 -> 2, 4, 1 decode rows; all three fit: steps at batch 3, 2, 1, 1
    assert roof.decode_batch_profile([3, 5, 2], max_num_seqs=8) == {3: 1, 2: 1, 1: 2}
    # two slots: requests 0 and 1 start, 2 joins when 0 leaves after 2 steps
    profile = roof.decode_batch_profile([3, 5, 2], max_num_seqs=2)
    assert profile == {2: 3, 1: 1} and sum(m * s for m, s in profile.items()) == 2 + 4 + 1
    assert roof.decode_batch_profile([1, 1], 4) == {}
    assert roof.decode_grid(48) == [1, 2, 4, 8, 16, 32, 48] and roof.decode_grid(1) == [1]
    flops = {(4, 4, 2): 64.0, (4, 4, 4): 256.0}  # 1 s per call at M = 2, 0.5 s at M = 4
    assert roof.call_seconds(flops, 4, 4, 3, [2, 4]) == pytest.approx(0.75)
    assert roof.call_seconds(flops, 4, 4, 8, [2, 4]) == pytest.approx(1.0)  # past the grid: the last rate
    assert roof.call_seconds(flops, 4, 4, 1, [2, 4]) == pytest.approx(0.5)
    shapes = roof.gemm_shapes(STORIES_CFG)
    rows = roof.workload_rows([3, 5], [4, 4])
    flat = {(s["n"], s["k"], m): 1e9 * m for s in shapes for m in (1, 2, 8)}
    full = roof.roofline_tokens_per_s(shapes, rows, flat, 8, 2)
    prof = roof.roofline_profile_tokens_per_s(shapes, rows, flat, 8, roof.decode_batch_profile([4, 4], 256), [1, 2])
    assert prof == pytest.approx(full, rel=1e-12)
    # the same workload with unequal lengths: its tail runs at batch 1, slower per row
    rows2 = roof.workload_rows([3, 5], [2, 6])
    tail = roof.roofline_profile_tokens_per_s(shapes, rows2, flat, 8, roof.decode_batch_profile([2, 6], 256), [1, 2])
    assert tail < roof.roofline_tokens_per_s(shapes, rows2, flat, 8, 2)


def test_roofline_measure_reports_what_trust_needs():
    """measure: the spread of every case's timed runs, torch.mm before and after, the float32 peak for a
    bf16 run, the machine's load before and after, the fixed thread count (restored after), the problems."""
    roof = load("_roofline")
    import torch

    shapes = roof.gemm_shapes(STORIES_CFG)
    threads = torch.get_num_threads()
    flops = roof.measure(shapes, 16, 4, "bfloat16", runs=3, min_seconds=0.001, budget_seconds=0.05, warmup_seconds=0.001,
                         paths=["F.linear", "fp32 weights"], threads=1)
    assert torch.get_num_threads() == threads and flops["threads"] == 1
    assert set(flops["spread"]) == {"F.linear", "fp32 weights"}
    assert all(v >= 1.0 for t in flops["spread"].values() for v in t.values())
    assert set(flops["spread"]["F.linear"]) == set(flops["by_path"]["F.linear"])
    assert flops["mm_before"] > 0 and flops["mm_after"] > 0 and flops["peak"] >= max(flops["mm_before"], flops["mm_after"])
    for when in ("before", "after"):
        assert flops["load"][when]["loadavg"] >= 0 and flops["load"][when]["cores"] == os.cpu_count()
        busy = flops["load"][when]["others_busy"]
        assert busy is None or 0 <= busy <= 1
    assert flops["problems"] == roof.problems(flops)


def test_roofline_problems_flag_implausible_runs():
    """Each implausibility is named; a clean run has none."""
    roof = load("_roofline")
    quiet = dict(loadavg=0.1, others_busy=0.02, cores=2)
    key = (576, 576, 1)

    def result(rate=50e9, spread=1.1, before=400e9, after=390e9, load_after=quiet, load_before=quiet):
        return dict(by_path={"F.linear": {key: rate}, "slow path": {key: rate / 2}}, linear={key: rate},
                    spread={"F.linear": {key: spread}, "slow path": {key: 5.0}},  # a noisy path the roofline does not take
                    mm_before=before, mm_after=after, peak=max(before, after), load=dict(before=load_before, after=load_after))

    assert roof.problems(result()) == []
    (p,) = roof.problems(result(rate=700e9))
    assert "[576, 576] at M=1: 700 GFLOP/s, over 1.5x the large-mm peak 400" in p
    (p,) = roof.problems(result(rate=0.10e9))  # the o_proj at M = 1 on a busy machine
    assert "best 0.1 GFLOP/s, under 1/1000 of the large-mm peak 400" in p
    (p,) = roof.problems(result(spread=3.5))
    assert "timed runs spread 3.50x (max / min), over 2.0x" in p
    (p,) = roof.problems(result(before=859e9, after=300e9))
    assert "torch.mm before / after the shapes: 859 / 300 GFLOP/s, over 1.5x apart" in p
    # after the shapes the load average counts the measurement's own threads: only others' use tells
    busy = roof.problems(result(load_after=dict(loadavg=8.1, others_busy=0.9, cores=2)))
    assert busy == ["machine busy after: other processes took 90% of the CPUs (over 25%)"]
    assert roof.problems(result(load_after=dict(loadavg=1.9, others_busy=0.0, cores=2))) == []
    assert roof.problems(result(load_before=dict(loadavg=1.6, others_busy=0.0, cores=2))) == []  # the run before, a minute ago
    busy = roof.problems(result(load_before=dict(loadavg=1.6, others_busy=0.6, cores=2)))
    assert busy == ["machine busy before: other processes took 60% of the CPUs (over 25%)"]
    assert roof.problems(result(load_after=dict(loadavg=None, others_busy=None, cores=2))) == []  # nothing to read: no claim
