"""Grammar bitmasks: which tokens each constrained row may sample, applied to its logits.

    bitmask: [rows, ceil(vocab / 32)] int32, bit j (least significant first) of word w allows token
             32 * w + j; a 0 bit sets that token's logit to -inf before sampling.

The layout is llguidance's and xgrammar's (and vLLM's). A bitmask may be wider than the logits
(the grammar's vocabulary padded to 32): bits past the logits' last column are ignored.
``apply_token_bitmask_reference`` is the plain oracle; ``apply_token_bitmask`` on the CPU: where at
most ``SPARSE_WORDS`` of the words are nonzero (a JSON grammar outside a string allows a few dozen
tokens of tens of thousands) it saves the allowed logits, fills the rows with -inf and writes them
back, touching the [rows, vocab] logits once; otherwise it unpacks the bits with ``numpy.unpackbits``
(one byte per token) and masks with ``masked_fill_``, a select over every element (measured on the
EPYC Zen 4, 2 threads: ~45 ms for [256, 49,152] bf16 logits, a sixth of a random-135m decode step).
Elsewhere (GPUs) the bits are unpacked with shifts.

``GrammarBitmask.candidates``: the rows whose mask allows at most ``MAX_CANDIDATES`` tokens, with
those tokens (``Candidates``), which the sampler samples among alone instead of masking the row.
Each such row is padded with -inf to the first of ``CANDIDATE_WIDTHS`` that holds its tokens, a
function of the row alone: torch's softmax sums a row in an order that depends on its length (one
lane per vector slot, a sequential sum below a vector's width), so padding a row to the widest row
of its step would make its probabilities, and a draw near a boundary between two tokens, depend on
what else shares the step. Only for vocabularies of ``MIN_CANDIDATE_VOCAB`` tokens or more (a
function of the model alone, so batch invariance holds): below, a full row is cheap to sample.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional
from typing import Sequence as Seq

import numpy as np
import torch

_SHIFTS = torch.arange(32, dtype=torch.int32)
SPARSE_WORDS = 1 / 16  #: the share of nonzero words up to which the CPU path gathers the allowed logits
MAX_CANDIDATES = 1024  #: rows allowing at most this many tokens are sampled among them alone (``Candidates``)
CANDIDATE_WIDTHS = (16, 128, MAX_CANDIDATES)  #: a candidate row's width: the first of these holding its tokens
#: vocabularies below this sample constrained rows over their full masked rows: the candidate path's
#: fixed cost (grouping by width, gathering; ~3 ms a step at 128 rows on stories260K's 512 tokens,
#: against ~0.6 ms for masking and sampling the full rows) pays only where a row is long
MIN_CANDIDATE_VOCAB = 2048


def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits: [R, V]; bitmask: [R, W >= ceil(V / 32)] int32. A new tensor: logits[r, t] where bit
    t of row r is set, else -inf."""
    t = torch.arange(logits.shape[1], device=logits.device)  # [V]
    bits = (bitmask.to(logits.device)[:, t // 32] >> (t % 32).to(torch.int32)) & 1  # [R, V]
    return logits.masked_fill(bits == 0, float("-inf"))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits [R, V] (any float dtype, any device) get -inf where bitmask [R, W] int32
    (on the CPU) has a 0 bit; same result as ``apply_token_bitmask_reference``. Runs under
    ``torch.inference_mode`` (the model's logits are inference tensors, written in place here)."""
    with torch.inference_mode():
        _apply(logits, bitmask)


def _apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    rows, vocab = logits.shape
    if logits.device.type == "cpu":
        words = bitmask.contiguous().numpy().view(np.uint32)  # [R, W]
        r, w = np.nonzero(words)  # the words that allow something
        if r.size <= SPARSE_WORDS * words.size:
            pair_rows, pair_tokens = _set_bits(words, r, w, vocab)
            row_ids, token_ids = torch.from_numpy(pair_rows), torch.from_numpy(pair_tokens)
            allowed = logits[row_ids, token_ids]  # [m]
            logits.fill_(float("-inf"))
            logits[row_ids, token_ids] = allowed
            return
        packed = words.view(np.uint8)  # [R, 4W], little-endian: byte 0 = tokens 0-7
        allowed = torch.from_numpy(np.unpackbits(packed, axis=1, count=vocab, bitorder="little"))  # [R, V] uint8
    else:
        words = bitmask.to(logits.device, non_blocking=True)
        allowed = ((words.unsqueeze(-1) >> _SHIFTS.to(logits.device)) & 1).view(rows, -1)[:, :vocab]  # [R, V]
    logits.masked_fill_(allowed == 0, float("-inf"))


def _set_bits(words: np.ndarray, r: np.ndarray, w: np.ndarray, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """The allowed (row, token) pairs of ``words`` [R, W] uint32 given its nonzero words (r, w) [n]
    (``np.nonzero`` order): (rows [m] int64, tokens [m] int64), row-major with each row's tokens
    ascending, tokens at or past ``vocab`` dropped."""
    bits = np.unpackbits(words[r, w].view(np.uint8).reshape(-1, 4), axis=1, bitorder="little")  # [n, 32]
    k, b = np.nonzero(bits)
    tokens = w[k].astype(np.int64) * 32 + b  # [m]
    inside = tokens < vocab
    return r[k][inside].astype(np.int64), tokens[inside]


@dataclass
class Candidates:
    """The tokens a grammar allows on some rows of a step, for sampling among them alone.

    rows: the batch rows (indices into the step's sequences), ascending; counts: [len(rows)] int64,
    each >= 1; pair_rows / pair_tokens: [sum(counts)] int64, position in ``rows`` and token id of
    every allowed token, row-major, each row's tokens ascending (vocabulary order)."""

    rows: list[int]
    counts: np.ndarray
    pair_rows: np.ndarray
    pair_tokens: np.ndarray

    def by_width(self) -> list[tuple[int, "Candidates"]]:
        """The rows split by width, the first of ``CANDIDATE_WIDTHS`` holding each row's tokens:
        (width, the ``Candidates`` of those rows), widths ascending. A row's width depends on its
        own count alone, so the bits of its sampling do not depend on the other rows of the step."""
        widths = np.asarray(CANDIDATE_WIDTHS)[np.searchsorted(CANDIDATE_WIDTHS, self.counts)]  # [len(rows)]
        if (widths == widths[0]).all():
            return [(int(widths[0]), self)]
        parts = []
        for width in np.unique(widths):
            keep = widths == width
            inside = keep[self.pair_rows]
            pair_rows = (np.cumsum(keep) - 1)[self.pair_rows[inside]]  # renumbered within the part
            rows = [row for row, k in zip(self.rows, keep) if k]
            parts.append((int(width), Candidates(rows, self.counts[keep], pair_rows, self.pair_tokens[inside])))
        return parts

    def gather(self, logits: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """From logits [N, V] (the step's rows, any device): (candidate logits [len(rows), width]
        float32, -inf past a row's count; candidate token ids [len(rows), width] int64, 0 past it),
        with ``width`` at least the largest count (``by_width``); column j of a row is its j-th
        allowed token in vocabulary order."""
        device, n = logits.device, len(self.rows)
        starts = np.cumsum(self.counts) - self.counts  # [n]
        cols = np.arange(self.pair_rows.size) - np.repeat(starts, self.counts)  # [m] column within its row
        batch_rows = np.asarray(self.rows, dtype=np.int64)[self.pair_rows]  # [m]
        index = torch.from_numpy(np.stack([self.pair_rows, cols, batch_rows, self.pair_tokens]))  # [4, m]
        if device.type != "cpu":
            index = index.to(device, non_blocking=True)  # one host-to-device copy
        pr, col, br, tok = index
        values = torch.full((n, width), float("-inf"), dtype=torch.float32, device=device)  # [n, width]
        values[pr, col] = logits[br, tok].float()
        ids = torch.zeros((n, width), dtype=torch.int64, device=device)  # [n, width]
        ids[pr, col] = tok
        return values, ids


class GrammarBitmask:
    """The bitmask rows of one step: ``bitmask[i]`` is for the sequence ``seq_ids[i]``; the
    sampler finds each one's logits row (vLLM's ``GrammarOutput``: request ids and their rows).

    ``pending``: a ``concurrent.futures.Future`` still filling ``bitmask`` on a helper thread while
    the model runs the step (structured_output/manager.py); reading ``bitmask`` (or pickling this, for a
    worker behind a pickled boundary) waits for it first and re-raises what the fill raised.
    """

    def __init__(self, seq_ids: list[int], bitmask: torch.Tensor, pending=None) -> None:
        self.seq_ids = seq_ids
        self._bitmask = bitmask  # [len(seq_ids), ceil(vocab / 32)] int32, CPU
        self._pending = pending

    @property
    def bitmask(self) -> torch.Tensor:
        self.wait()
        return self._bitmask

    def wait(self) -> None:
        """Block until the rows are filled (at once when they are); re-raises the fill's error."""
        if self._pending is not None:
            self._pending.result()  # raises again on every read if the fill failed
            self._pending = None

    def __getstate__(self) -> dict:
        return {"seq_ids": self.seq_ids, "_bitmask": self.bitmask, "_pending": None}

    def candidates(self, seqs: Seq, eligible: Seq[bool], vocab: int) -> Optional[Candidates]:
        """The constrained rows among ``seqs`` with ``eligible[i]`` whose grammar allows between 1
        and ``MAX_CANDIDATES`` tokens below ``vocab``, with those tokens; None when there are none.
        A row-wise choice (it depends on the row's own mask alone), so batch invariance holds."""
        where = {seq_id: i for i, seq_id in enumerate(self.seq_ids)}
        rows = [i for i, s in enumerate(seqs) if eligible[i] and s.seq_id in where]
        if not rows:
            return None
        words = self.bitmask[[where[seqs[i].seq_id] for i in rows]].numpy().view(np.uint32)  # [len(rows), W]
        few = np.count_nonzero(words, axis=1) <= MAX_CANDIDATES  # a row has at least as many tokens as nonzero words
        words = words[few]
        r, w = np.nonzero(words)
        pair_rows, pair_tokens = _set_bits(words, r, w, vocab)
        counts = np.bincount(pair_rows, minlength=words.shape[0])  # [rows with few words]
        keep = (counts >= 1) & (counts <= MAX_CANDIDATES)
        if not keep.any():
            return None
        if not keep.all():  # drop the rows allowing no token or too many, renumber the others
            inside = keep[pair_rows]
            pair_rows, pair_tokens = (np.cumsum(keep) - 1)[pair_rows[inside]], pair_tokens[inside]
        few_rows = [row for row, f in zip(rows, few) if f]
        return Candidates([row for row, k in zip(few_rows, keep) if k], counts[keep], pair_rows, pair_tokens)

    def apply(self, logits: torch.Tensor, seqs: Seq, skip: Seq[int] = ()) -> torch.Tensor:
        """Mask ``logits`` [len(seqs), V] (row i for seqs[i]) in place, on the constrained rows only
        (not the rows in ``skip``, sampled among their ``candidates`` instead)."""
        with torch.inference_mode():
            return self._apply(logits, seqs, set(skip))

    def _apply(self, logits: torch.Tensor, seqs: Seq, skip: set) -> torch.Tensor:
        where = {seq_id: i for i, seq_id in enumerate(self.seq_ids)}
        rows = [i for i, s in enumerate(seqs) if s.seq_id in where and i not in skip]
        if not rows:
            return logits
        order = [where[seqs[i].seq_id] for i in rows]
        bitmask = self.bitmask if order == list(range(len(self.seq_ids))) else self.bitmask[order]
        if len(rows) == logits.shape[0]:
            _apply(logits, bitmask)
        else:
            index = torch.tensor(rows, device=logits.device)
            part = logits.index_select(0, index)  # [len(rows), V]
            _apply(part, bitmask)
            logits.index_copy_(0, index, part)
        return logits
