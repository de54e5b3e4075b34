"""Short, readable reprs for the result and parameter classes (a notebook cell, a log line).

A dataclass's generated repr prints every field in full: thousands of token ids, every logprob
entry. These helpers print the fields that matter, cut long texts and token lists (saying how long
they were), and give IPython's pretty printer (``_repr_pretty_``) the same fields so that it wraps
them over lines instead of one endless line. ``fields`` below is a list of (name, value) pairs whose
values are already rendered text, except a ``list`` of child objects, which is printed with the
children's own reprs (and pretty printers).
"""
from __future__ import annotations

from typing import Optional, Sequence

TEXT_LIMIT = 80  # characters of a text shown before it is cut
IDS_HEAD, IDS_TAIL = 8, 2  # token ids shown at each end of a long list

Fields = list[tuple[str, object]]


def text(s: Optional[str], limit: int = TEXT_LIMIT) -> str:
    """``repr(s)``, cut to about ``limit`` characters with the full length said after it."""
    if s is None or len(s) <= limit:
        return repr(s)
    return f"{s[:limit]!r}… ({len(s):,} chars)"


def ids(token_ids: Sequence[int]) -> str:
    """A token-id list, its middle left out when it is long: ``[1, 2, …, 9] (64 tokens)``."""
    n = len(token_ids)
    if n <= IDS_HEAD + IDS_TAIL + 2:
        return repr(list(token_ids))
    head = ", ".join(map(str, token_ids[:IDS_HEAD]))
    tail = ", ".join(map(str, token_ids[n - IDS_TAIL:]))
    return f"[{head}, …, {tail}] ({n:,} tokens)"


def logprobs(entries: Optional[list]) -> str:
    """A per-position logprobs list in a few words: ``<32 positions, top 5>``."""
    if entries is None:
        return "None"
    widths = [len(e) for e in entries if e]
    return f"<{len(entries)} positions, up to {max(widths, default=0)} tokens each>"


def number(x: float) -> str:
    return f"{x:.4g}"


def render(name: str, fields: Fields) -> str:
    """``Name(a=1, b=[Child(...), ...])`` on one line."""
    def value(v) -> str:
        return "[" + ", ".join(repr(c) for c in v) + "]" if isinstance(v, list) else str(v)

    return f"{name}(" + ", ".join(f"{k}={value(v)}" for k, v in fields) + ")"


def pretty(p, name: str, fields: Fields, cycle: bool) -> None:
    """IPython's ``_repr_pretty_``: the same fields, wrapped over lines where they do not fit."""
    if cycle:
        p.text(f"{name}(...)")
        return
    with p.group(len(name) + 1, f"{name}(", ")"):
        for i, (k, v) in enumerate(fields):
            if i:
                p.text(",")
                p.breakable()
            p.text(f"{k}=")
            if isinstance(v, list):
                with p.group(len(k) + 2, "[", "]"):
                    for j, child in enumerate(v):
                        if j:
                            p.text(",")
                            p.breakable()
                        p.pretty(child)
            else:
                p.text(str(v))


def engine_stats(s) -> Fields:
    """The ``EngineStats`` fields that matter: always the step, token and KV-cache figures with the
    prefix-cache hit rate and the blocks saved by sharing (a zero there is an answer too); the
    preemption kinds, cached tokens and copy-on-write count when they are not zero."""
    always = ("num_steps", "num_preemptions", "num_prefill_tokens", "num_decode_tokens", "num_generated_tokens",
              "num_kv_blocks", "num_used_blocks", "peak_used_blocks", "kv_utilization_mean", "prefix_cache_hit_rate",
              "sharing_savings_mean", "peak_sharing_savings")
    when_set = ("num_recomputes", "num_swaps_out", "num_swaps_in", "num_cached_tokens", "num_copy_on_write",
                "num_draft_tokens", "num_accepted_tokens", "acceptance_rate_per_position", "num_jump_forward_tokens",
                "quantization")
    fields = [] if s.kv_cache_dtype == "auto" else [("kv_cache_dtype", s.kv_cache_dtype)]
    for name in always + when_set:
        value = getattr(s, name)
        if name in always or value:
            fields.append((name, number(value) if isinstance(value, float) else repr(value) if isinstance(value, str) else str(value)))
    return fields
