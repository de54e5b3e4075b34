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
"""
from __future__ import annotations

from typing import Sequence as Seq

import numpy as np
import torch

_SHIFTS = torch.arange(32, dtype=torch.int32)
SPARSE_WORDS = 1 / 16  #: the share of nonzero words up to which the CPU path gathers the allowed logits


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
            bits = np.unpackbits(words[r, w].view(np.uint8).reshape(-1, 4), axis=1, bitorder="little")  # [n, 32]
            k, b = np.nonzero(bits)
            tokens = w[k].astype(np.int64) * 32 + b  # [m] allowed (row, token) pairs, tokens past the vocab dropped
            inside = tokens < vocab
            row_ids, token_ids = torch.from_numpy(r[k][inside].astype(np.int64)), torch.from_numpy(tokens[inside])
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


class GrammarBitmask:
    """The bitmask rows of one step: ``bitmask[i]`` is for the sequence ``seq_ids[i]``; the
    sampler finds each one's logits row (vLLM's ``GrammarOutput``: request ids and their rows).

    ``pending``: a ``concurrent.futures.Future`` still filling ``bitmask`` on a helper thread while
    the model runs the step (engine/grammar.py); reading ``bitmask`` (or pickling this, for a
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

    def apply(self, logits: torch.Tensor, seqs: Seq) -> torch.Tensor:
        """Mask ``logits`` [len(seqs), V] (row i for seqs[i]) in place, on the constrained rows only."""
        with torch.inference_mode():
            return self._apply(logits, seqs)

    def _apply(self, logits: torch.Tensor, seqs: Seq) -> torch.Tensor:
        where = {seq_id: i for i, seq_id in enumerate(self.seq_ids)}
        rows = [i for i, s in enumerate(seqs) if s.seq_id in where]
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
