"""Turns the logits of the sequences that finish a step into their next tokens (and logprobs).

Order of work, as vLLM v1's sampler (vllm/v1/sample/sampler.py):
1. logprobs, if a row asks: log-softmax of the raw logits (see engine/logprobs.py);
2. allowed_token_ids, logit bias and min_tokens (EOS / stop tokens banned while fewer than
   min_tokens are generated);
3. repetition, frequency and presence penalties;
4. greedy rows take the argmax here;
5. other rows: temperature, min-p, top-k, top-p (engine/logits_processors.py), then sampling with
   the exponential race: ``argmax(probs / q)`` with ``q ~ Exp(1)`` draws from ``probs``.

A sequence with its own generator (its request has a seed) draws its ``q`` from it, one vector
per sampled token, and every step of the pipeline is row-wise: its tokens do not depend on what
else shares the batch, on the batch order, or on preemption. Others share the engine's generator.

Fast path: when every row is greedy and no row asks for logprobs, penalties, logit bias,
allowed_token_ids or min_tokens, a step is one argmax; deciding that looks only at the distinct
SamplingParams.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional, Sequence as Seq

import torch

from pagedgen.engine import logits_processors as lp
from pagedgen.engine.logprobs import logprob_dicts
from pagedgen.engine.sequence import Sequence
from pagedgen.outputs import Logprob


def make_generator(seed: Optional[int], index: int = 0) -> Optional[torch.Generator]:
    """The generator of completion ``index`` of a request with ``seed`` (None without a seed).

    Completion 0 uses the seed itself; completion j > 0 a 64-bit seed derived from (seed, j) by
    BLAKE2b, so the n completions are different streams and each is reproducible on its own.
    """
    if seed is None:
        return None
    if index:
        digest = hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest()
        seed = int.from_bytes(digest, "little")
    return torch.Generator().manual_seed(seed)


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim: [N, vocab] -> [N] int64. ``max(dim).indices`` returns the same ids as
    ``argmax`` (the first maximal index on ties, NaN counting as the maximum) and is about twice as
    fast on the CPU."""
    return logits.max(dim=-1).indices


@dataclass
class SamplerOutput:
    """token_ids[i] is row i's new token; logprobs is None when no row asked, else per row a
    {token id: Logprob} (None for rows that did not ask)."""

    token_ids: list[int]
    logprobs: Optional[list[Optional[dict[int, Logprob]]]] = None


class Sampler:
    """Picks one token per row.

    Args:
        seed: seed of the engine's generator, used by requests without a seed of their own.
    """

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: Seq[Sequence]) -> SamplerOutput:
        """logits: [num_seqs, vocab] float32 on the CPU, row i for seqs[i]."""
        params = [s.sampling_params for s in seqs]
        kinds = {id(p): p for p in params}.values()
        all_greedy = all(p.greedy for p in kinds)
        want_logprobs = any(p.logprobs is not None for p in kinds)
        processed = any(p.has_penalties or p.logit_bias or p.min_tokens or p.allowed_token_ids for p in kinds)
        if all_greedy and not want_logprobs and not processed:  # the fast path: one argmax
            return SamplerOutput(greedy_ids(logits).tolist())

        raw_logprobs = None
        if want_logprobs:
            lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
            raw_logprobs = logits[lp_rows].log_softmax(dim=-1)  # [L, vocab]
        if processed:
            logits = self._process(logits, seqs, params)
        sampled = self._sample(logits, seqs, params, all_greedy)  # [num_seqs] int64

        logprobs = None
        if want_logprobs:
            dicts = logprob_dicts(raw_logprobs, sampled[lp_rows], [params[i].logprobs for i in lp_rows])
            logprobs = [None] * len(seqs)
            for i, d in zip(lp_rows, dicts):
                logprobs[i] = d
        return SamplerOutput(sampled.tolist(), logprobs)

    @staticmethod
    def _process(logits: torch.Tensor, seqs: Seq[Sequence], params) -> torch.Tensor:
        """Allowed token ids, logit bias, min_tokens bans and penalties, for the rows that ask (steps 2-3)."""
        vocab = logits.shape[1]
        bias_rows, bias_ids, bias_vals, ban_rows, ban_ids, pen_rows = [], [], [], [], [], []
        allow_rows, allow_ids = [], []
        for i, (seq, p) in enumerate(zip(seqs, params)):
            if p.allowed_token_ids:
                allow_rows.extend([i] * len(p.allowed_token_ids))
                allow_ids.extend(p.allowed_token_ids)
            if p.logit_bias:
                bias_rows.extend([i] * len(p.logit_bias))
                bias_ids.extend(p.logit_bias.keys())
                bias_vals.extend(p.logit_bias.values())
            if p.min_tokens and seq.num_output_tokens < p.min_tokens:
                banned = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | seq.eos_token_ids
                ban_rows.extend([i] * len(banned))
                ban_ids.extend(banned)
            if p.has_penalties:
                pen_rows.append(i)
        if allow_rows:
            logits = lp.apply_allowed_token_ids(logits, torch.tensor(allow_rows), torch.tensor(allow_ids, dtype=torch.int64))
        if bias_rows:
            logits = lp.apply_logit_bias(
                logits, torch.tensor(bias_rows), torch.tensor(bias_ids), torch.tensor(bias_vals, dtype=torch.float32)
            )
        if ban_rows:
            logits = lp.apply_token_ban(logits, torch.tensor(ban_rows), torch.tensor(ban_ids, dtype=torch.int64))
        if pen_rows:
            rows = torch.tensor(pen_rows)
            pen_seqs = [seqs[i] for i in pen_rows]
            pen_params = [params[i] for i in pen_rows]
            seen = lp.token_counts([s.token_ids for s in pen_seqs], vocab) > 0
            counts = lp.token_counts([s.output_token_ids for s in pen_seqs], vocab)
            penalised = lp.apply_penalties(
                logits[rows],
                seen,
                counts,
                torch.tensor([p.presence_penalty for p in pen_params], dtype=torch.float32),
                torch.tensor([p.frequency_penalty for p in pen_params], dtype=torch.float32),
                torch.tensor([p.repetition_penalty for p in pen_params], dtype=torch.float32),
            )
            logits = logits.index_copy(0, rows, penalised)
        return logits

    def _sample(self, logits: torch.Tensor, seqs: Seq[Sequence], params, all_greedy: bool) -> torch.Tensor:
        """Steps 4-5: [num_seqs] int64 token ids."""
        if all_greedy:
            return greedy_ids(logits)
        greedy = [p.greedy for p in params]
        temps = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)], dtype=torch.float32)
        x = logits / temps.unsqueeze(1)
        if any(p.min_p > 0.0 and not g for p, g in zip(params, greedy)):
            x = lp.apply_min_p(x, torch.tensor([0.0 if g else p.min_p for p, g in zip(params, greedy)], dtype=torch.float32))
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64)
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
            x = lp.apply_top_k_top_p(x, top_k, top_p)
        probs = x.softmax(dim=-1)  # [num_seqs, vocab]

        q = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, seq in enumerate(seqs):
            if seq.generator is not None and not greedy[i]:
                q[i] = torch.empty(probs.shape[1], dtype=probs.dtype).exponential_(generator=seq.generator)
        # q = 0 would turn a zero probability into 0/0 = NaN, which argmax picks
        sampled = (probs / q.clamp_(min=torch.finfo(q.dtype).tiny)).argmax(dim=-1)
        if any(greedy):
            rows = torch.tensor(greedy)
            sampled[rows] = greedy_ids(logits[rows])
        return sampled
