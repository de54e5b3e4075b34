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

from pagedgen.spec_decode.config import SpeculativeConfig


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


INDEX_MAX_N = 8  # the longest n-gram an NgramIndex keeps (its keys are tuples of n tokens)


class NgramIndex:
    """``propose`` for one sequence whose token ids only grow, at a cost per new token instead of
    per token of the sequence: for each n in ``[min_n, max_n]`` a dict from every n-gram that ends
    before the sequence's last token to where the text went on after its most recent occurrence.

        tokens  a b c d a b c e a b c        n = 3, after 10 end positions (0..9) are indexed:
        {(a,b,c): 8, (b,c,d): 4, (c,d,a): 5, (d,a,b): 6, (b,c,e): 8, (c,e,a): 9, (e,a,b): 10}
                                             suffix (a,b,c) -> 8: propose tokens[8..] with period 3

    Each call indexes the n-grams ending at the positions added since the last one (a token at
    position j ends one n-gram of each n), then looks up the suffix: bit for bit ``propose``
    (tests/spec_decode/test_speculative.py). Keys are tuples of n tokens, so ``max_n`` is kept small
    (``INDEX_MAX_N``; the engine calls ``propose`` for longer lookups).
    """

    __slots__ = ("min_n", "max_n", "maps", "done")

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n <= INDEX_MAX_N:
            raise ValueError(f"NgramIndex needs 1 <= min_n <= max_n <= {INDEX_MAX_N}, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.maps: list[dict] = [{} for _ in range(max_n + 1)]  # maps[n]: n-gram tuple -> start of what followed it
        self.done = 0  # end positions 0 .. done - 1 are indexed

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens for ``tokens`` (this sequence's token ids, a longer list than at
        the previous call or the same one)."""
        length = len(tokens)
        if length - 1 < self.done:  # not the sequence this index was built for: start again
            self.maps, self.done = [{} for _ in range(self.max_n + 1)], 0
        maps, lo, hi, done = self.maps, self.min_n, self.max_n, self.done
        if done < length - 1:  # index the end positions before the last token, in order within each n
            for n in range(lo, hi + 1):
                grams = maps[n]
                for j in range(max(done, n - 1), length - 1):
                    grams[tuple(tokens[j - n + 1 : j + 1])] = j + 1
            self.done = length - 1
        for n in range(min(hi, length - 1), lo - 1, -1):
            start = maps[n].get(tuple(tokens[length - n :]))
            if start is not None:
                period = length - start
                if period >= k:
                    return tokens[start : start + k]
                return [tokens[start + m % period] for m in range(k)]
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
