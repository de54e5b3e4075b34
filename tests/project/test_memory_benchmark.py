"""benchmarks/memory.py --quick: every section runs end to end and reports sane figures (~15 s)."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, SHARED, STORIES, TINYSTORIES

SCRIPT = os.path.join(ROOT, "benchmarks", "memory.py")
SHAREGPT = os.path.join(SHARED, "data", "sharegpt_lengths_sarathi", "sharegpt_8k_filtered_stats_llama2_tokenizer.csv")


def test_quick_run_reports_every_section(tmp_path):
    for path in (STORIES, TINYSTORIES, SHAREGPT):
        if not os.path.exists(path):
            pytest.skip(f"{path} not found")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # one thread: two threads stall each other when the 2-core CI machine is busy
    proc = subprocess.run([sys.executable, SCRIPT, "--quick", "--threads", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(tmp_path / "memory.json") as f:
        results = json.load(f)
    assert (tmp_path / "memory.txt").read_text().startswith("KV utilisation")

    util = results["util"]
    for key in ("pagedgen", "contiguous_max", "contiguous_pow2", "contiguous_oracle"):
        assert 0.0 < util[key] <= 1.0, (key, util[key])
    assert util["contiguous_max"] <= util["contiguous_pow2"] <= util["contiguous_oracle"] < util["pagedgen"]

    for workload in ("sharegpt", "alpaca"):
        for mode in ("parallel", "beam"):
            figures = results["sharing"][workload][mode]
            assert set(figures) == {"2", "4", "6"}
            for width, r in figures.items():
                assert 0.0 <= r["savings_mean"] <= r["peak_savings"] < 1.0, (workload, mode, width, r)
            assert figures["6"]["savings_mean"] > figures["2"]["savings_mean"] > 0.0  # wider fans share more

    for length in ("80", "341"):
        r = results["prefix"][length]
        assert r["tok_s_on"] > 0 and r["tok_s_off"] > 0 and r["ratio"] > 0
        assert 0.0 < r["prefix_cache_hit_rate"] < 1.0


def test_bad_sections_is_a_usage_error():
    proc = subprocess.run([sys.executable, SCRIPT, "--sections", "util,speed"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--sections" in proc.stderr
