"""Figures of a recorded run (matplotlib; install with ``pip install 'pagedgen[plot]'``).

    log = llm.start_recording()
    outputs = llm.generate(prompts, params)
    llm.stop_recording()
    fig = pagedgen.plot.steps(log)            # KV cache, sequences and tokens per step
    fig.savefig("steps.png")                  # or leave it as a notebook cell's last line
    pagedgen.plot.output_tokens(outputs)      # output tokens per request

The functions build a ``matplotlib.figure.Figure`` without pyplot: no GUI backend or display is
needed (PNG files are written with Agg), nothing is kept open between calls, and in a notebook the
returned figure shows as the cell's result exactly once.
"""
from __future__ import annotations

import io
from typing import Optional, Sequence

try:
    from matplotlib.figure import Figure as _Figure
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("pagedgen.plot needs matplotlib: pip install 'pagedgen[plot]' (or pip install matplotlib)") from exc

import numpy as np

from pagedgen.engine.step_log import StepLog
from pagedgen.outputs import RequestOutput

COLORS = {"usage": "#1f77b4", "utilization": "#2ca02c", "running": "#1f77b4", "waiting": "#ff7f0e",
          "swapped": "#9467bd", "preemption": "#d62728", "prefill": "#8c564b", "decode": "#17becf",
          "stop": "#2ca02c", "length": "#1f77b4", "other": "#7f7f7f"}


class Figure(_Figure):
    """A matplotlib Figure that IPython shows as a PNG (``_repr_png_``) without pyplot."""

    def _repr_png_(self) -> bytes:
        buf = io.BytesIO()
        self.savefig(buf, format="png", bbox_inches="tight")
        return buf.getvalue()


def steps(log: StepLog, *, title: Optional[str] = None) -> Figure:
    """The KV cache and the batch over the steps of a recorded run (PagedAttention paper, figure 2
    and section 6: memory held by real tokens vs reserved).

    Three panels sharing the step axis: (1) blocks in use as a share of the cache and the
    utilisation of those blocks (slots holding tokens / slots allocated), in %; (2) sequences
    running, waiting and swapped out, with the steps that preempted marked; (3) tokens computed per
    step, prefill and decode stacked.

    Args:
        log: a ``StepLog`` from ``LLM.start_recording()`` with at least one step.
        title: the figure's title (default: a summary of the run).

    Returns:
        a ``Figure`` (save it with ``fig.savefig(path)``).

    Raises:
        TypeError: ``log`` is not a StepLog.
        ValueError: the log holds no steps.
    """
    if not isinstance(log, StepLog):
        raise TypeError(f"steps() takes a StepLog (from LLM.start_recording()), got {type(log).__name__}")
    if not len(log):
        raise ValueError("the StepLog holds no steps: call LLM.start_recording(), then generate, then plot")
    x = np.arange(len(log))
    fig = Figure(figsize=(9, 7.5), layout="constrained")
    ax_kv, ax_seq, ax_tok = fig.subplots(3, 1, sharex=True)

    ax_kv.plot(x, 100 * log.kv_usage, color=COLORS["usage"], label=f"blocks in use (of {log.num_kv_blocks})")
    ax_kv.plot(x, 100 * log.kv_utilization, color=COLORS["utilization"], label="utilisation of blocks in use")
    ax_kv.set_ylim(0, 105)
    ax_kv.set_ylabel("KV cache (%)")
    ax_kv.legend(loc="lower right", fontsize="small")

    ax_seq.plot(x, log.num_running, color=COLORS["running"], label="running")
    ax_seq.plot(x, log.num_waiting, color=COLORS["waiting"], label="waiting")
    if log.num_swapped.any():
        ax_seq.plot(x, log.num_swapped, color=COLORS["swapped"], label="swapped")
    preempted = log.num_preemptions > 0
    if preempted.any():
        ax_seq.plot(x[preempted], log.num_running[preempted], "x", color=COLORS["preemption"],
                    label=f"preemption ({int(log.num_preemptions.sum())})")
    ax_seq.set_ylabel("sequences")
    ax_seq.set_ylim(bottom=0)
    ax_seq.legend(loc="upper right", fontsize="small")

    ax_tok.stackplot(x, log.num_prefill_tokens, log.num_decode_tokens, colors=[COLORS["prefill"], COLORS["decode"]],
                     labels=["prefill", "decode"], step="mid")
    ax_tok.set_ylabel("tokens per step")
    ax_tok.set_xlabel("step")
    ax_tok.legend(loc="upper right", fontsize="small")
    ax_tok.set_xlim(0, max(len(log) - 1, 1))

    if title is None:
        title = (f"{len(log)} steps, {log.time_s[-1]:.2f} s: KV utilisation mean {log.kv_utilization.mean():.1%}, "
                 f"peak {log.kv_usage.max():.0%} of {log.num_kv_blocks} blocks, {int(log.num_preemptions.sum())} preemptions")
    fig.suptitle(title, fontsize="medium")
    return fig


def output_tokens(outputs: Sequence[RequestOutput], *, title: Optional[str] = None) -> Figure:
    """Output tokens of each request, its completions stacked and coloured by finish reason
    ("stop": EOS, stop token or string; "length": max_tokens or max_model_len).

    Args:
        outputs: what ``LLM.generate`` or ``LLM.chat`` returned (one or more RequestOutputs).
        title: the figure's title (default: counts and the mean).

    Returns:
        a ``Figure``.

    Raises:
        TypeError: an item is not a RequestOutput (its index is named).
        ValueError: ``outputs`` is empty.
    """
    outputs = list(outputs)
    if not outputs:
        raise ValueError("output_tokens() needs at least one RequestOutput")
    for i, out in enumerate(outputs):
        if not isinstance(out, RequestOutput):
            raise TypeError(f"output_tokens() takes RequestOutputs; item {i} is a {type(out).__name__}")
    fig = Figure(figsize=(9, 3.5), layout="constrained")
    ax = fig.subplots()
    x = np.arange(len(outputs))
    bottom = np.zeros(len(outputs))
    seen = set()
    for j in range(max(len(o.outputs) for o in outputs)):
        heights = np.array([len(o.outputs[j].token_ids) if j < len(o.outputs) else 0 for o in outputs], dtype=float)
        reasons = [o.outputs[j].finish_reason if j < len(o.outputs) else None for o in outputs]
        for reason in dict.fromkeys(r for r in reasons if r is not None):
            mask = np.array([r == reason for r in reasons])
            key = reason if reason in COLORS else "other"
            ax.bar(x[mask], heights[mask], bottom=bottom[mask], width=1.0 if len(outputs) > 64 else 0.8,
                   color=COLORS[key], label=None if reason in seen else f"finish_reason={reason!r}")
            seen.add(reason)
        bottom += heights
    ax.set_xlabel("request (input order)")
    ax.set_ylabel("output tokens")
    ax.set_xlim(-0.5, len(outputs) - 0.5)
    ax.legend(loc="upper right", fontsize="small")
    if title is None:
        n = sum(len(o.outputs) for o in outputs)
        title = f"{len(outputs)} requests, {n} completions, {int(bottom.sum()):,} output tokens (mean {bottom.mean():.1f} per request)"
    ax.set_title(title, fontsize="medium")
    return fig
