"""benchmarks/logprobs_cost.py (issue 50): a tiny run of its three parts on stories260K, the numbers'
sanity, not their size (timings on a shared machine mean nothing)."""
import json
import os
import sys

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import logprobs_cost  # noqa: E402

import pagedgen.ops  # noqa: E402


def test_tiny_run_reports_every_part(stories_path, tmp_path, one_torch_thread):
    report = logprobs_cost.main(["--quick", "--num-prompts", "4", "--max-tokens", "16", "--repeats", "1", "--long-prompt", "300",
                                 "--threads", "1", "--out", str(tmp_path)])
    t = report["throughput"]
    assert t["same_tokens"] and t["output_tokens"] == 64 and t["median_on"] > 0 and t["median_off"] > 0
    kr = report["kernel"]  # one step's logprobs: the kernel (where built) against its reference, the same ids and ranks
    assert kr["rows"] == 32 and kr["vocab"] == 512 and kr["same_ids_and_ranks"] and min(kr["us_per_row"].values()) > 0
    assert kr["kernel_loaded"] == pagedgen.ops.has_kernel("logprob_topk")
    runs = {r["setting"]: r for r in report["memory"]["runs"]}
    assert runs["none"]["max_lm_head_rows"] == 1  # the sampled row alone
    for setting in ("prompt_logprobs=0", "prompt_logprobs=5"):  # 299 prompt rows, never at once
        assert runs[setting]["max_lm_head_rows"] == 256 and runs[setting]["prompt_tokens"] == 300
        assert runs[setting]["peak_rss_after"] >= runs[setting]["peak_rss_before"] > 0
    assert report["memory"]["full_log_softmax_bytes"] == 300 * 512 * 4
    assert json.loads((tmp_path / "logprobs_cost.json").read_text()) == json.loads(json.dumps(report))
