"""benchmarks/plots.py draws the charts of docs/benchmarks.md from the benchmarks' JSON, and
benchmarks/step_log.py measures recording on vs off (a tiny run)."""
import json
import os
import sys

import pytest

from conftest import ROOT

pytest.importorskip("matplotlib")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import plots  # noqa: E402
import step_log as step_log_bench  # noqa: E402
from png_check import check_png  # noqa: E402

MEMORY = {
    "util": dict(num_requests=300, pagedgen=0.992, contiguous_max=0.473, contiguous_pow2=0.605, contiguous_oracle=0.784),
    "sharing": {w: {m: {str(k): dict(savings_mean=0.1 * k / 2 + (0.2 if m == "beam" else 0.0)) for k in (2, 4, 6)}
                    for m in ("parallel", "beam")} for w in ("sharegpt", "alpaca")},
}


def test_throughput_rows_read_both_layouts():
    old = {"args": {"model": "x/stories260K", "num_prompts": 1000, "repeats": 3},
           "tokens_per_s": {"pagedgen": 40000.0, "static": 8000.0, "static_batch_32": 4000.0, "static_batch_256": 8000.0,
                            "generate_batch": 1000.0, "pagedgen/static": 5.0}}
    assert plots.throughput_rows(old) == [("pagedgen", 40000.0), ("static, batch 256", 8000.0), ("static, batch 32", 4000.0),
                                          ("generate_batch", 1000.0)]
    new = {"summary": {"tokens_per_s": {"vllm": 500.0, "pagedgen": 480.0, "static, batch 64": 160.0}}}
    assert [n for n, _ in plots.throughput_rows(new)] == ["vllm", "pagedgen", "static, batch 64"]
    with pytest.raises(ValueError, match="no systems"):
        plots.throughput_rows({"summary": {"tokens_per_s": {}}})


def test_charts_written_as_png(tmp_path):
    tp, mem = tmp_path / "throughput.json", tmp_path / "memory.json"
    tp.write_text(json.dumps({"tokens_per_s": {"pagedgen": 40139.0, "static": 7683.0, "generate_batch": 1131.0}}))
    mem.write_text(json.dumps(MEMORY))
    written = plots.main(["--throughput", str(tp), "--memory", str(mem), "--out", str(tmp_path / "docs")])
    assert [os.path.basename(p) for p in written] == ["benchmarks-throughput.png", "benchmarks-memory.png"]
    for path in written:
        with open(path, "rb") as f:
            check_png(f.read())
    labels = [t.get_text() for t in plots.throughput_chart(json.loads(tp.read_text())).axes[0].texts]
    assert any("pagedgen 5.2×" in t for t in labels) and any("pagedgen 35.5×" in t for t in labels)
    with pytest.raises(ValueError, match="util"):
        plots.memory_chart({"sharing": MEMORY["sharing"]})


def test_step_log_benchmark_tiny_run(stories_path, tmp_path, one_torch_thread):
    out = step_log_bench.main(["--num-prompts", "6", "--max-tokens", "24", "--repeats", "1", "--max-num-seqs", "4", "--timeit-calls", "2000", "--out", str(tmp_path)])
    (r,) = out["results"]
    assert r["identical_outputs"] and r["steps_per_run"] > 0 and r["tok_s_on"] > 0 and r["tok_s_off"] > 0
    assert 0 < r["record_call_s"] < 1e-3 and 0 < r["off_check_s"] < r["record_call_s"]
    assert json.loads((tmp_path / "step_log.json").read_text())["results"][0]["max_num_seqs"] == 4


def test_one_command_keeps_the_json_and_redraws_from_it(tmp_path):
    """--throughput/--memory copy each JSON beside its PNG; without options both charts are redrawn
    from those copies; a bad file writes nothing."""
    tp, mem, docs = tmp_path / "tp.json", tmp_path / "mem.json", tmp_path / "docs"
    harness = {"args": {"model": "random-135m", "dtype": "bfloat16", "device": "cpu", "workload": "sharegpt", "num_prompts": 128, "repeats": 3},
               "summary": {"tokens_per_s": {"pagedgen": 349.0, "vllm": 439.0, "static, batch 64": 120.0}}}
    tp.write_text(json.dumps(harness))
    mem.write_text(json.dumps(MEMORY))
    plots.main(["--throughput", str(tp), "--memory", str(mem), "--out", str(docs)])
    assert json.loads((docs / "benchmarks-throughput.json").read_text()) == harness
    assert json.loads((docs / "benchmarks-memory.json").read_text()) == MEMORY
    title = plots.throughput_chart(harness).axes[0].get_title()
    assert title.startswith("random-135m (bfloat16), sharegpt, 128 requests") and "median of 3 runs" in title
    for png in docs.glob("*.png"):
        png.unlink()
    written = plots.main(["--out", str(docs)])
    assert sorted(os.path.basename(p) for p in written) == ["benchmarks-memory.png", "benchmarks-throughput.png"]
    for path in written:
        with open(path, "rb") as f:
            check_png(f.read())
    (tmp_path / "bad.json").write_text(json.dumps({"summary": {"tokens_per_s": {}}}))
    with pytest.raises(ValueError, match="no systems"):
        plots.main(["--throughput", str(tmp_path / "bad.json"), "--memory", str(mem), "--out", str(tmp_path / "empty")])
    assert not (tmp_path / "empty").exists()
    with pytest.raises(SystemExit):
        plots.main(["--out", str(tmp_path / "empty")])  # nothing given, nothing kept there
