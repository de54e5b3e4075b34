"""Turns the logits of the sequences that finish a step into their next tokens.

Greedy rows take the argmax. Other rows are divided by their temperature, filtered by top-k and
top-p (the same rules as Hugging Face's ``TopKLogitsWarper`` / ``TopPLogitsWarper``), and sampled
with the exponential-race trick: ``argmax(probs / q)`` with ``q ~ Exp(1)`` draws from ``probs``.
A request with a seed draws its ``q`` from its own generator, so its tokens do not depend on what
else shares the batch; the others share the engine's generator.
"""
from __future__ import annotations

from typing import Optional, Sequence as Seq

import torch

from pagedgen.engine.sequence import Sequence


def apply_top_k_top_p(
    logits: torch.Tensor,  # [num_seqs, vocab] float32
    top_k: Optional[torch.Tensor],  # [num_seqs] int64, 0 = keep all
    top_p: Optional[torch.Tensor],  # [num_seqs] float32, 1.0 = keep all
) -> torch.Tensor:
    """Mask (to -inf) the tokens that top-k or top-p removes. Returns new logits [num_seqs, vocab]."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)  # ascending
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


class Sampler:
    """Picks one token per row.

    Args:
        seed: seed of the engine's generator, used by requests without a seed of their own.
    """

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: Seq[Sequence]) -> list[int]:
        """logits: [num_seqs, vocab] float32 on the CPU, row i for seqs[i]. Returns token ids."""
        params = [s.sampling_params for s in seqs]
        greedy = [p.greedy for p in params]
        if all(greedy):
            return logits.argmax(dim=-1).tolist()

        temps = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)], dtype=torch.float32)
        x = logits / temps.unsqueeze(1)
        if any(p.top_k > 0 for p in params) or any(p.top_p < 1.0 for p in params):
            top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64)
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
            x = apply_top_k_top_p(x, top_k, top_p)
        probs = x.softmax(dim=-1)  # [num_seqs, vocab]

        q = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, seq in enumerate(seqs):
            if seq.generator is not None and not greedy[i]:
                q[i] = torch.empty(probs.shape[1], dtype=probs.dtype).exponential_(generator=seq.generator)
        sampled = (probs / q).argmax(dim=-1)
        if any(greedy):
            rows = torch.tensor(greedy)
            sampled[rows] = logits[rows].argmax(dim=-1)
        return sampled.tolist()
