"""Selection logic of one prompt's beam search, step by step, as transformers' beam search does it
(``GenerationMixin._beam_search`` in transformers 5: top 2k continuations, the best k unfinished
ones run on, finished ones enter a k-slot pool scored with the length penalty, and the same
stopping rules). Tensors only for the per-step top-k; the engine turns the decisions into forks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedgen.beam_search import BeamSearchParams

_NEG = -1.0e9  # transformers' "impossible" score


def beam_score(cum_logprob: float, length: int, length_penalty: float) -> float:
    """A finished beam's score: ``cum_logprob / length ** length_penalty``, length counting the
    generated tokens (EOS included), as transformers' ``BeamHypotheses.add``."""
    return cum_logprob / (length ** length_penalty)


@dataclass
class Hypothesis:
    """A finished beam: its generated tokens, summed log-probability and length-penalised score."""

    token_ids: list[int]
    cum_logprob: float
    score: float
    finish_reason: str


@dataclass
class Continuation:
    """A running beam for the next step: ``parent`` (index into the current beams) + ``token``."""

    parent: int
    token: int
    cum_logprob: float


@dataclass(eq=False)
class BeamGroup:
    """The beam search of one prompt.

    Args:
        params: beam width, max_tokens, length penalty, early stopping, ignore_eos.
        prompt_len: tokens of the prompt.
        eos_token_ids: tokens that finish a beam (unless ignore_eos).
        max_len: most tokens of prompt + output (max_model_len); reaching it finishes a beam too.
    """

    params: BeamSearchParams
    prompt_len: int
    eos_token_ids: frozenset[int]
    max_len: int
    finished: list[Hypothesis] = field(default_factory=list)
    heuristic_unsatisfied: bool = True
    done: bool = False
    beams: list = field(default_factory=list)  # the running beams' Sequences (kept by the engine)
    pending: dict = field(default_factory=dict)  # seq_id -> log-probabilities [vocab] of this step

    @property
    def max_total_len(self) -> int:
        return min(self.prompt_len + self.params.max_tokens, self.max_len)

    def step(
        self,
        logprobs: torch.Tensor,  # [num_beams, vocab] float32, log-softmax of each running beam's logits
        cum_logprobs: list[float],  # [num_beams] running scores (sum of generated log-probabilities)
        histories: list[list[int]],  # [num_beams] generated tokens so far (all of equal length)
    ) -> list[Continuation]:
        """One beam-search step. Returns the beams to run on (empty when the search is over)."""
        k = self.params.beam_width
        num_beams, vocab = logprobs.shape
        cur_len = self.prompt_len + len(histories[0])
        acc = logprobs + torch.tensor(cum_logprobs, dtype=torch.float32)[:, None]  # [num_beams, vocab]
        # transformers keeps k beams from the start (beams 1.. at -1e9); padding them keeps ties equal
        if num_beams < k:
            acc = torch.cat([acc, torch.full((k - num_beams, vocab), _NEG) + logprobs[:1]], dim=0)
        top_vals, top_idx = torch.topk(acc.reshape(-1), k=2 * k)  # beams_to_keep = 2k
        # a padded row (first step only) has the same history as beam 0
        parents = [p if p < num_beams else 0 for p in (top_idx // vocab).tolist()]
        tokens = (top_idx % vocab).tolist()
        vals = top_vals.tolist()
        ends_len = cur_len + 1 >= self.max_total_len
        hits = [ends_len or (not self.params.ignore_eos and t in self.eos_token_ids) for t in tokens]

        # the best k continuations that did not finish run on
        pen = top_vals + torch.tensor(hits, dtype=torch.float32) * _NEG
        next_idx = torch.topk(pen, k=k).indices.tolist()
        running = [Continuation(parents[i], tokens[i], float(pen[i])) for i in next_idx]

        # finished continuations among the top k enter the pool of k best hypotheses
        pool_full = len(self.finished) == k
        accept = self.heuristic_unsatisfied and not (pool_full and self.params.early_stopping is True)
        gen_len = cur_len + 1 - self.prompt_len
        if accept:
            new = [
                Hypothesis(
                    histories[parents[r]] + [tokens[r]],
                    vals[r],
                    beam_score(vals[r], gen_len, self.params.length_penalty),
                    "stop" if (not self.params.ignore_eos and tokens[r] in self.eos_token_ids) else "length",
                )
                for r in range(k)
                if hits[r]
            ]
            merged = self.finished + new  # stable: earlier hypotheses win ties, as topk over the concatenation
            merged.sort(key=lambda h: -h.score)
            self.finished = merged[:k]

        # stopping rules (transformers' _check_early_stop_heuristic / _beam_search_has_unfinished_sequences)
        cur_len += 1
        if self.params.early_stopping == "never" and self.params.length_penalty > 0.0:
            best_len = self.max_total_len - self.prompt_len
        else:
            best_len = cur_len - self.prompt_len
        best_possible = running[0].cum_logprob / (best_len ** self.params.length_penalty)
        if len(self.finished) == k:
            worst = min(h.score for h in self.finished)
            self.heuristic_unsatisfied = self.heuristic_unsatisfied and best_possible > worst
        exists_open = not (len(self.finished) == k and self.params.early_stopping is True)
        valid = not all(hits)
        if not (self.heuristic_unsatisfied and exists_open and valid) or cur_len >= self.max_total_len:
            self.done = True
            return []
        return running
