"""Charts of the benchmarks' JSON output, written as PNG files for docs/benchmarks.md.

After new benchmark runs, one command redraws both charts and keeps the JSON they are drawn from
beside them (docs/benchmarks.md links both):

    python benchmarks/throughput.py --out /tmp/tp && python benchmarks/memory.py --out /tmp/mem
    python benchmarks/plots.py --throughput /tmp/tp/throughput.json --memory /tmp/mem/memory.json

writes ``docs/benchmarks-throughput.png`` (output tokens/s of pagedgen and its peers, with
pagedgen's ratio to each) and ``docs/benchmarks-memory.png`` (KV-cache utilisation of the paged
cache vs contiguous reservation, laid out like the PagedAttention paper's figure 2, and the memory
saved by sharing beside the paper's ranges, when the memory run has that section), and copies each
JSON given to ``docs/benchmarks-throughput.json`` / ``docs/benchmarks-memory.json``. Either option
alone redraws only its chart. Without options it redraws both charts from the JSON kept in docs/.
``--out`` picks another folder for all four files. Needs matplotlib (``pip install
'pagedgen[plot]'``); no display.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # memory.py, beside this file (run as a script)
from memory import PAPER  # noqa: E402

from pagedgen.plot import COLORS, Figure  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGED, PEER, WASTE = COLORS["usage"], COLORS["other"], "#d9d9d9"


def throughput_rows(data: dict) -> list[tuple[str, float]]:
    """(system, output tok/s) from throughput.py's JSON, fastest first. Reads both layouts: the
    current one (``summary.tokens_per_s``, one entry per system row) and the earlier one
    (top-level ``tokens_per_s`` with ``static_batch_N`` rows, ``static`` = the best of them, and
    ``a/b`` ratios)."""
    if "summary" in data:
        rows = dict(data["summary"]["tokens_per_s"])
    else:
        raw = data["tokens_per_s"]
        rows = {k: v for k, v in raw.items() if "/" not in k and not (k == "static" and any(x.startswith("static_batch_") for x in raw))}
        rows = {k.replace("static_batch_", "static, batch ") if k.startswith("static_batch_") else k: v for k, v in rows.items()}
    if not rows:
        raise ValueError("throughput JSON holds no systems")
    return sorted(rows.items(), key=lambda kv: -kv[1])


def label(system: str) -> str:
    """A peer's name as a reader knows it: ``static, batch 64`` -> transformers' generate, ..."""
    for key, name in (("static", "transformers generate, static"), ("generate_batch", "transformers generate_batch"),
                      ("vllm", "vLLM")):
        if system.startswith(key):
            rest = system[len(key):].strip(", ()")
            return name + (f" ({rest})" if rest else " (best batch)" if key == "static" else "")
    return system


def throughput_chart(data: dict) -> Figure:
    """Horizontal bars of output tokens/s per system; each peer labelled with pagedgen's ratio to it."""
    rows = throughput_rows(data)
    names, tps = [n for n, _ in rows], np.array([t for _, t in rows])
    ours = dict(rows).get("pagedgen")
    fig = Figure(figsize=(8, 0.5 * len(rows) + 1.6), layout="constrained")
    ax = fig.subplots()
    y = np.arange(len(rows))[::-1]
    ax.barh(y, tps, color=[PAGED if n == "pagedgen" else PEER for n in names])
    for yi, name, value in zip(y, names, tps):
        note = f"{value:,.0f}" + (f"   (pagedgen {ours / value:.1f}×)" if ours and name != "pagedgen" else "")
        ax.text(value, yi, "  " + note, va="center", fontsize="small")
    ax.set_yticks(y, [label(n) for n in names])
    ax.set_xlim(0, tps.max() * 1.45)
    ax.set_xlabel("output tokens/s (higher is better)")
    args = data.get("args", {})
    model = os.path.basename(str(args.get("model", ""))) or "model"
    setting = ", ".join(str(args[k]) for k in ("dtype", "device") if args.get(k) not in (None, "auto", "cpu"))
    runs = args.get("repeats", 1)
    ax.set_title(f"{model}{f' ({setting})' if setting else ''}, {args.get('workload', 'tinystories')}, "
                 f"{args.get('num_prompts', '?')} requests, greedy, "
                 + (f"median of {runs} runs" if runs > 1 else "one run"), fontsize="medium")
    if data.get("note"):
        fig.supxlabel(data["note"], fontsize="x-small", color="#555555")
    return fig


def memory_chart(data: dict) -> Figure:
    """Left: share of reserved KV memory holding real tokens vs wasted, per system (paper figure 2);
    right, when present: memory saved by sharing per width, with the paper's ranges."""
    if "util" not in data:
        raise ValueError("memory JSON has no 'util' section (run benchmarks/memory.py with --sections util)")
    u, sharing = data["util"], data.get("sharing")
    fig = Figure(figsize=(12 if sharing else 6, 4.8), layout="constrained")
    axes = fig.subplots(1, 2, width_ratios=(1, 1.5)) if sharing else [fig.subplots()]
    ax = axes[0]
    systems = [("pagedgen\n(paged, 16-token blocks)", u["pagedgen"]), ("contiguous,\nreserve final\n(oracle)", u["contiguous_oracle"]),
               ("contiguous,\nreserve pow2", u["contiguous_pow2"]), ("contiguous,\nreserve max_model_len", u["contiguous_max"])]
    x = np.arange(len(systems))
    used = np.array([v for _, v in systems]) * 100
    ax.bar(x, used, color=[PAGED] + [PEER] * 3, label="token states", zorder=2)
    ax.bar(x, 100 - used, bottom=used, color=WASTE, label="reserved, unused", zorder=2)
    for xi, v in zip(x, used):
        ax.text(xi, v / 2, f"{v:.1f}%", ha="center", va="center", color="white", fontsize="small", fontweight="bold", zorder=3)
    lo, hi = PAPER["util"]["existing systems"]
    ax.axhspan(100 * lo, 100 * hi, color=COLORS["waiting"], alpha=0.25, zorder=0, label=f"paper: existing systems {100 * lo:.0f}-{100 * hi:.0f}%")
    ax.axhline(100 * PAPER["util"]["vLLM"][0], color=COLORS["preemption"], ls="--", lw=1, zorder=4, label=f"paper: vLLM {100 * PAPER['util']['vLLM'][0]:.1f}%")
    ax.set_xticks(x, [s for s, _ in systems], fontsize="x-small")
    ax.set_ylim(0, 100)
    ax.set_ylabel("KV cache memory (%)")
    ax.set_title(f"KV utilisation, ShareGPT lengths, {u['num_requests']} requests", fontsize="medium")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, fontsize="x-small")
    if sharing:
        ax = axes[1]
        groups = [(w, m) for w in sharing for m in ("parallel", "beam")]
        widths = sorted({int(k) for w, m in groups for k in sharing[w][m]})
        step = 0.8 / len(widths)
        for i, width in enumerate(widths):
            vals = [100 * sharing[w][m][str(width)]["savings_mean"] for w, m in groups]
            ax.bar(np.arange(len(groups)) + (i - (len(widths) - 1) / 2) * step, vals, step * 0.95,
                   color=PAGED, alpha=0.45 + 0.55 * (i + 1) / len(widths), label=f"width {width}")
        for g, (w, m) in enumerate(groups):
            lo, hi = PAPER[m][w]
            ax.plot([g + 0.45, g + 0.45], [100 * lo, 100 * hi], color=COLORS["preemption"], lw=3, solid_capstyle="butt",
                    label="paper (widths 2-6)" if g == 0 else None)
        ax.set_xticks(np.arange(len(groups)), [f"{w}\n{'parallel sampling' if m == 'parallel' else 'beam search'}" for w, m in groups],
                      fontsize="x-small")
        ax.set_ylabel("KV blocks saved by sharing (%)")
        ax.set_title("Memory saved by sharing (mean over steps)", fontsize="medium")
        ax.legend(loc="upper left", fontsize="x-small")
    return fig


CHARTS = (("throughput", throughput_chart), ("memory", memory_chart))  # -> benchmarks-NAME.png / .json


def main(argv=None) -> list[str]:
    """Draw the charts; returns the paths of the PNG files written."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--throughput", help="throughput.json written by benchmarks/throughput.py --out")
    ap.add_argument("--memory", help="memory.json written by benchmarks/memory.py --out")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs"), help="folder for the PNG and JSON files (default: docs/)")
    args = ap.parse_args(argv)
    sources = {name: getattr(args, name) for name, _ in CHARTS}
    if not any(sources.values()):  # redraw from the JSON kept beside the charts
        sources = {name: os.path.join(args.out, f"benchmarks-{name}.json") for name, _ in CHARTS}
        missing = [p for p in sources.values() if not os.path.isfile(p)]
        if missing:
            ap.error(f"no --throughput or --memory given, and {', '.join(missing)} not found")
    charts = []
    for name, chart in CHARTS:  # all read and drawn before anything is written
        if sources[name]:
            with open(sources[name]) as f:
                data = json.load(f)
            charts.append((name, sources[name], chart(data)))
    os.makedirs(args.out, exist_ok=True)
    written = []
    for name, source, fig in charts:
        path = os.path.join(args.out, f"benchmarks-{name}.png")
        fig.savefig(path, dpi=110)
        written.append(path)
        kept = os.path.join(args.out, f"benchmarks-{name}.json")
        if not os.path.exists(kept) or not os.path.samefile(source, kept):
            shutil.copyfile(source, kept)
            print(f"wrote {path} and {kept}")
        else:
            print(f"wrote {path}")
    return written


if __name__ == "__main__":
    main()
