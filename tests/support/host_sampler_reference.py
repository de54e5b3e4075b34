"""The host sampler as it was before sampling moved to the logits' device (pagedgen 2026-12-04,
sample/sampler.py at 153bf80): the oracle of tests/sample/test_sampler_device.py. Every tensor lives on
the CPU and results come back with several ``.tolist()`` calls."""
from __future__ import annotations

from operator import attrgetter
from typing import Optional
from typing import Sequence as Seq

import torch

from pagedgen.core.sequence import Sequence
from pagedgen.sample import logits_processors as lp
from pagedgen.sample.logprobs import logprob_dicts
from pagedgen.sample.sampler import SamplerOutput, counter_uniforms, greedy_ids, inverse_cdf_sample, unseeded_key
from pagedgen.structured_output.token_bitmask import GrammarBitmask

_PLAIN_GREEDY = attrgetter("plain_greedy")


class HostSampler:
    """Picks one token per row.

    Args:
        seed: the engine's seed, the key of the draws of requests without a seed of their own.
    """

    def __init__(self, seed: int) -> None:
        self.unseeded_key = unseeded_key(seed)

    def __call__(self, logits: torch.Tensor, seqs: Seq[Sequence], grammar_bitmask: Optional[GrammarBitmask] = None) -> SamplerOutput:
        """logits: [num_seqs, vocab] on the CPU (float32 or the model's bf16/fp16), row i for seqs[i].
        The fast path takes the argmax in the logits' own dtype; every other path works in float32.
        ``grammar_bitmask``: the structured-output rows of this step (structured_output/grammar.py), applied
        first, in place (vLLM's order: logprobs are then those of the masked logits)."""
        if grammar_bitmask is not None:
            logits = grammar_bitmask.apply(logits, seqs)
        if all(map(_PLAIN_GREEDY, seqs)):  # the fast path: one argmax
            return SamplerOutput(greedy_ids(logits).tolist())
        params = [s.sampling_params for s in seqs]
        kinds = {id(p): p for p in params}.values()
        all_greedy = all(p.greedy for p in kinds)
        want_logprobs = any(p.logprobs is not None for p in kinds)
        processed = any(p.changes_logits for p in kinds)
        logits = logits.float()  # [num_seqs, vocab] float32 (no copy when it is already)

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
        """Steps 4-5: [num_seqs] int64 token ids. Greedy rows take the argmax and pay nothing for
        the sampled ones: temperature, filters, softmax and the draw run on the sampled rows only."""
        if all_greedy:
            return greedy_ids(logits)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        x = logits[rows] if greedy_rows else logits  # [R, vocab], the sampled rows
        sp = [params[i] for i in rows]
        temps = torch.tensor([p.temperature for p in sp], dtype=torch.float32)
        x = x / temps.unsqueeze(1)
        if any(p.min_p > 0.0 for p in sp):
            x = lp.apply_min_p(x, torch.tensor([p.min_p for p in sp], dtype=torch.float32))
        filtered = [r for r, p in enumerate(sp) if p.top_k > 0 or p.top_p < 1.0]
        if filtered:  # top-k / top-p sort the vocabulary: only the rows that ask for it
            fp = [sp[r] for r in filtered]
            top_k = torch.tensor([p.top_k for p in fp], dtype=torch.int64)
            top_p = torch.tensor([p.top_p for p in fp], dtype=torch.float32)
            if len(filtered) == len(sp):
                x = lp.apply_top_k_top_p(x, top_k, top_p)
            else:
                index = torch.tensor(filtered)
                x = x.index_copy(0, index, lp.apply_top_k_top_p(x[index], top_k, top_p))
        probs = x.softmax(dim=-1)  # [R, vocab]
        tokens = inverse_cdf_sample(probs, self._uniforms([seqs[i] for i in rows]))  # [R]
        if not greedy_rows:
            return tokens
        sampled = torch.empty(len(params), dtype=torch.int64)
        sampled[rows] = tokens
        sampled[greedy_rows] = greedy_ids(logits[greedy_rows])
        return sampled

    def _uniforms(self, seqs: Seq[Sequence]) -> torch.Tensor:
        """One U[0, 1) float64 draw per row (see the module docstring): keyed by the request's seed
        and the completion index, or by the engine's key and the sequence id for a request
        without a seed; the position is that of the token being drawn."""
        unseeded = self.unseeded_key
        keys = [unseeded if s.seed is None else s.seed for s in seqs]
        streams = [s.seq_id if s.seed is None else s.index for s in seqs]
        positions = [len(s.token_ids) for s in seqs]
        return counter_uniforms(keys, streams, positions)
