"""The tables of benchmarks/throughput.py: tokens/s, peak memory and roofline share per system,
agreement of greedy outputs between systems, ratios against the issue-9 targets.

``runs[label]`` is the list of one row's results over the repeats (benchmarks/_job.py format);
a row is a system, or static batching at one batch size.
"""
from __future__ import annotations

import statistics

GIB = 1024**3
# (numerator, denominator, target ratio) printed when both rows ran; the static target is stories260K's
TARGETS = (("pagedgen", "vllm", 1.5), ("pagedgen", "static", 5.0), ("pagedgen", "generate_batch", 1.0))
ROOFLINE_TARGET = 0.60  # pagedgen, TinyStories, random-135m, bf16


def rate(x: float) -> str:
    """Tokens/s for a table: whole numbers from 100 on, three significant digits below."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def median_seconds(results: list[dict]) -> float:
    return statistics.median(r["seconds"] for r in results)


def tok_per_s(results: list[dict], useful_tokens: int) -> float:
    return useful_tokens / median_seconds(results)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first output token where ``a`` and ``b`` differ (None when identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Share of requests with identical outputs and the first-divergence positions of the others."""
    firsts = [first_divergence(x, y) for x, y in zip(a, b)]
    diverged = sorted(f for f in firsts if f is not None)
    return dict(identical=len(firsts) - len(diverged), requests=len(firsts), first_divergence=diverged)


def describe_agreement(name_a: str, name_b: str, agr: dict) -> str:
    line = (f"identical greedy outputs, {name_a} vs {name_b}: {agr['identical']}/{agr['requests']} requests "
            f"({agr['identical'] / agr['requests']:.1%})")
    d = agr["first_divergence"]
    if d:
        line += (f"; the others first differ at output token min/median/max {d[0]}/{statistics.median(d):g}/{d[-1]}"
                 f" (0-based)")
    return line


def best_static(runs: dict) -> str | None:
    """Label of the fastest static-batching row (None without static rows)."""
    static = [label for label in runs if label.startswith("static")]
    return min(static, key=lambda label: median_seconds(runs[label]), default=None)


def system_of(label: str) -> str:
    return label.split(",")[0]


def report(runs: dict, useful_tokens: int, roofline_tok_s: float | None, repeats: int, say,
           profile_roofline_tok_s: float | None = None) -> dict:
    """Print the tables; return the summary (tok/s, peak RSS, roofline shares of the full-batch and
    of the batch-profile roofline, ratios, agreement)."""
    say(f"\n{'system':<26}{'output tok/s':>13}{'seconds':>9}{'computed tok':>14}{'peak RSS':>11}{'roofline':>10}{'profile':>9}")
    summary = dict(tokens_per_s={}, peak_rss_gib={}, roofline_share={}, profile_roofline_share={}, ratios={}, agreement={})
    best = best_static(runs)
    for label, results in runs.items():
        tps = tok_per_s(results, useful_tokens)
        rss = max(r["peak_rss_bytes"] for r in results) / GIB
        share = tps / roofline_tok_s if roofline_tok_s else None
        pshare = tps / profile_roofline_tok_s if profile_roofline_tok_s else None
        summary["tokens_per_s"][label], summary["peak_rss_gib"][label], summary["roofline_share"][label] = tps, rss, share
        summary["profile_roofline_share"][label] = pshare
        shown = label + (" (best)" if label == best and sum(k.startswith("static") for k in runs) > 1 else "")
        say(f"{shown:<26}{rate(tps):>13}{median_seconds(results):>9.2f}{results[0]['computed_tokens']:>14,}"
            f"{rss:>8.2f} GiB{(f'{share:.1%}' if share is not None else '-'):>10}{(f'{pshare:.1%}' if pshare is not None else '-'):>9}")
    say(f"output tok/s: {useful_tokens:,} useful output tokens (each request's own max_tokens) / median wall seconds of "
        f"{repeats} run(s); static batching computes every request of a batch to the batch's largest max_tokens "
        f"(computed tok). peak RSS: the runner process and its children, model load included (max over runs). "
        f"roofline: output tok/s as a share of what the measured matmul FLOP/s allow with every decode row in a full "
        f"batch; profile: the same at the batches the workload allows (ideal continuous batching).")

    # one row per system for ratios and agreement: static at its best batch size
    per_system = {system_of(label): label for label in runs if not label.startswith("static") or label == best}
    for num, den, target in TARGETS:
        if num in per_system and den in per_system:
            ratio = summary["tokens_per_s"][per_system[num]] / summary["tokens_per_s"][per_system[den]]
            summary["ratios"][f"{num}/{den}"] = ratio
            say(f"{num} / {per_system[den]:<20} {ratio:6.2f}x   (target >= {target:g}x: {'met' if ratio >= target else 'NOT met'})")
    names = list(per_system)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            agr = agreement(runs[per_system[a]][-1]["output_token_ids"], runs[per_system[b]][-1]["output_token_ids"])
            summary["agreement"][f"{a} vs {b}"] = agr
            say(describe_agreement(a, b, agr))
    for label, results in runs.items():
        if any(r["output_token_ids"] != results[0]["output_token_ids"] for r in results[1:]):
            say(f"note: {label}'s outputs differ between its runs (not deterministic across processes)")
    return summary
