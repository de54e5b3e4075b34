"""N-gram (prompt lookup) proposals: draft tokens copied from a sequence's own prompt and output.

For n from ``prompt_lookup_max`` down to ``prompt_lookup_min``: take the sequence's last n tokens
(its suffix), find the most recent earlier place where those n tokens occur, and propose the k
tokens that followed them there. The first n that matches wins; no match, no proposal.

    tokens  a b c d a b c e a b c        suffix (n=3) "a b c" occurs at 0, 4 and 8 (itself);
            0       4       8            the most recent earlier one starts at 4: propose "e a b"
                                         (k=3); k=8: "e a b c e a b c"

A match d tokens back says the text repeats with period d, so a continuation that runs into the
sequence's end goes on with the proposal itself (token m of the proposal is the one at
``start + m % d``): a model stuck in a loop of d tokens gets all k proposals, not d - 1. (vLLM's
prompt lookup stops at the end and proposes fewer.)

No model is involved; the target verifies every proposal, so a bad one costs a rejected row, never a
wrong token. ``propose_reference`` is the plain loop the vectorised version is tested against.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pagedgen.spec.config import SpeculativeConfig


def propose(token_ids, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` draft tokens for a sequence whose tokens (prompt + output) are ``token_ids``."""
    tokens = np.asarray(token_ids, dtype=np.int64)  # [L]
    length = tokens.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]  # [n]
        windows = sliding_window_view(tokens[: length - 1], n)  # [L - n, n]: window i = tokens[i : i + n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))  # starts of earlier occurrences
        if hits.size:
            start = int(hits[-1]) + n  # the most recent one
            period = length - start  # >= 1
            return tokens[start + np.arange(k) % period].tolist()
    return []


def propose_reference(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """``propose`` as a plain loop (the oracle of the tests)."""
    tokens = list(token_ids)
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= length:
            continue
        suffix = tokens[length - n:]
        for i in range(length - n - 1, -1, -1):
            if tokens[i : i + n] == suffix:
                start = i + n
                return [tokens[start + m % (length - start)] for m in range(k)]
    return []


class NgramProposer:
    """Draft tokens for a batch of sequences, by ``config`` (method "ngram")."""

    def __init__(self, config: SpeculativeConfig) -> None:
        if config.method != "ngram":
            raise ValueError(f"NgramProposer needs method 'ngram', got {config.method!r}")
        self.config = config

    def propose(self, batch: Sequence[Sequence[int]], num_running: Optional[int] = None) -> list[list[int]]:
        """Draft tokens per sequence of ``batch`` (each its token ids); none for any when
        ``num_running`` reaches ``disable_by_batch_size``."""
        cfg = self.config
        if cfg.disable_by_batch_size is not None and (num_running if num_running is not None else len(batch)) >= cfg.disable_by_batch_size:
            return [[] for _ in batch]
        return [propose(ids, cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) for ids in batch]
