"""Logits processors: plain functions over a batch of rows, each with per-row parameters.

All take ``logits`` [num_rows, vocab] float32 and return a new tensor of the same shape (the input
is not modified). A filtered-out token gets -inf. Semantics, checked against transformers'
``transformers.generation.logits_process`` in tests/sample/test_logits_processors.py:

- ``apply_penalties``: repetition penalty as ``RepetitionPenaltyLogitsProcessor`` (CTRL, Keskar et
  al. 2019) over prompt + output tokens: a seen token's logit x becomes x / r if x > 0, else x * r.
  Then presence and frequency penalties as in the OpenAI API over output tokens only:
  x[j] -= frequency * count[j] + presence * (count[j] > 0). vLLM applies them in that order.
- ``apply_logit_bias``: x[j] += bias[j] (OpenAI ``logit_bias``; ``SequenceBiasLogitsProcessor``
  with one-token sequences).
- ``apply_token_ban``: x[j] = -inf for the given (row, token) pairs (min_tokens suppressing EOS
  and stop tokens, as ``MinNewTokensLengthLogitsProcessor``).
- ``apply_allowed_token_ids``: x[j] = -inf for every token outside a row's allowed set (vLLM's
  ``allowed_token_ids``; ``PrefixConstrainedLogitsProcessor`` with a fixed set).
- ``apply_min_p``: drop tokens with p[j] < min_p * max(p) (``MinPLogitsWarper``; Nguyen et al. 2024).
- ``apply_top_k_top_p``: ``TopKLogitsWarper`` then ``TopPLogitsWarper`` (Holtzman et al. 2019),
  always keeping the most likely token.
"""
from __future__ import annotations

from itertools import chain
from typing import Optional

import torch


def token_counts(token_ids: list[list[int]], vocab_size: int, device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """How often each token appears in each row's list: [num_rows, vocab] float32 on ``device``.
    The ids go to the device in one copy, then one scatter-add counts them (no per-token Python work)."""
    counts = torch.zeros(len(token_ids), vocab_size, dtype=torch.float32, device=device)
    lengths = [len(t) for t in token_ids]
    total = sum(lengths)
    if total == 0:
        return counts
    rows = torch.repeat_interleave(torch.arange(len(token_ids)), torch.tensor(lengths), output_size=total)  # [N]
    flat = torch.stack([rows, torch.tensor(list(chain.from_iterable(token_ids)), dtype=torch.int64)])  # [2, N]
    rows, flat = flat.to(device) if device.type != "cpu" else flat
    counts.view(-1).index_add_(0, rows * vocab_size + flat, torch.ones(total, device=device))
    return counts


def apply_penalties(
    logits: torch.Tensor,  # [R, V] float32
    seen: torch.Tensor,  # [R, V] bool: token in prompt or output (repetition penalty)
    output_counts: torch.Tensor,  # [R, V] float32: times the token appears in the output
    presence: torch.Tensor,  # [R] float32, 0 = off
    frequency: torch.Tensor,  # [R] float32, 0 = off
    repetition: torch.Tensor,  # [R] float32, 1 = off
) -> torch.Tensor:
    """Repetition, then frequency and presence penalties (see the module docstring)."""
    r = torch.where(seen, repetition.unsqueeze(1), torch.ones_like(logits))
    x = torch.where(logits > 0, logits / r, logits * r)
    return x - frequency.unsqueeze(1) * output_counts - presence.unsqueeze(1) * (output_counts > 0).float()


def apply_logit_bias(
    logits: torch.Tensor,  # [R, V] float32
    rows: torch.Tensor,  # [B] int64
    token_ids: torch.Tensor,  # [B] int64
    biases: torch.Tensor,  # [B] float32
) -> torch.Tensor:
    """Add ``biases[b]`` to ``logits[rows[b], token_ids[b]]``."""
    return logits.index_put((rows, token_ids), biases, accumulate=True)


def apply_token_ban(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Set ``logits[rows[b], token_ids[b]]`` to -inf (rows, token_ids: [B] int64)."""
    return logits.index_put((rows, token_ids), torch.tensor(float("-inf"), device=logits.device))


def apply_allowed_token_ids(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Keep only the (row, token) pairs given (rows, token_ids: [B] int64) in the rows that appear
    in ``rows``; the other tokens of those rows get -inf, other rows are unchanged."""
    drop = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)  # [R, V]
    drop[rows] = True
    drop[rows, token_ids] = False
    return logits.masked_fill(drop, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than ``min_p`` [R] float32 times the row's most likely token."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor,  # [R, V] float32
    top_k: Optional[torch.Tensor],  # [R] int64, 0 = keep all
    top_p: Optional[torch.Tensor],  # [R] float32, 1.0 = keep all
) -> torch.Tensor:
    """Mask (to -inf) the tokens that top-k, then top-p, removes."""
    vocab = logits.shape[-1]
    # stable: equal logits (frequent in bf16) keep token-id order, so top-p drops the same ones in any batch
    sorted_logits, order = logits.sort(dim=-1, descending=False, stable=True)  # ascending
    if top_k is not None:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
        kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))  # the k-th largest value
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
