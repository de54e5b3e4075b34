"""Rejection sampling of draft tokens (Leviathan et al. 2023, section 2.3; Chen et al. 2023, alg. 2).

One sequence's verification step: the target's probabilities at its k + 1 rows (the last committed
token, then each of the k draft tokens), the k draft tokens and the draft's probabilities q (None for
n-gram proposals: q is one-hot on the draft token).

    row i < k:  accept draft d_i with probability min(1, p_i(d_i) / q_i(d_i))   (u_i * q < p)
                else emit one token from normalise(max(0, p_i - q_i)) and stop  (the recovered token)
    all k accepted: emit one more from p_k                                     (the bonus token)

The emitted tokens follow the target's distribution whatever the draft (the tests check it with a
chi-square test and a deliberately bad draft). Greedy rows (temperature 0) accept while the draft
equals the target's argmax and then emit that argmax: the output equals non-speculative greedy.

Draws are counter-based, like the sampler's (sample/sampler.py): the accept draw of the token at
position p uses stream ``stream ^ ACCEPT_STREAM``, the recovered and bonus draws ``stream ^
RESIDUAL_STREAM`` and the draft model's own draw of its proposal ``stream ^ DRAFT_STREAM``, so
none collides with the ordinary draw (stream, p) and a seeded request's tokens do not depend on its
batch company (only on where its steps begin: see docs/speculative.md).

``DraftGroup`` / ``resample_groups``: the draft-model method's verification inside the target's
sampler (``Sampler.__call__(resample=...)``): each verified sequence's k + 1 rows are re-decided by
``rejection_sample_batch`` (``rejection_sample`` for all of them at once, in tensor ops on the
logits' device) from the target's processed probabilities and the draft's q.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from pagedgen.sample.sampler import as_int64, counter_uniforms, inverse_cdf_sample

ACCEPT_STREAM = 0x5A5A_0000_0000_0001
RESIDUAL_STREAM = 0x5A5A_0000_0000_0002
DRAFT_STREAM = 0x5A5A_0000_0000_0003  # the draft model's proposals (spec_decode/draft_model.py)


def spec_uniforms(key: int, stream: int, first_position: int, count: int, tag: int) -> torch.Tensor:
    """``count`` draws [count] float64 for positions first_position.. of stream ``stream ^ tag``."""
    return counter_uniforms([key] * count, [as_int64(stream ^ tag)] * count, list(range(first_position, first_position + count)))


def rejection_sample(
    target_probs: torch.Tensor,
    draft_ids: list[int],
    draft_probs: Optional[torch.Tensor],
    accept_u: torch.Tensor,
    residual_u: torch.Tensor,
) -> list[int]:
    """The tokens one verification step emits (1 to k + 1 of them).

    Args:
        target_probs: [k + 1, vocab] the target's probabilities (after temperature and filters).
        draft_ids: the k draft tokens.
        draft_probs: [k, vocab] the draft's probabilities, or None (n-gram: one-hot on the draft).
        accept_u: [k] float64 U[0, 1) accept draws; residual_u: [k + 1] float64 recovered/bonus draws.
    """
    k = len(draft_ids)
    out: list[int] = []
    for i, d in enumerate(draft_ids):
        p_row = target_probs[i].double()  # [vocab]
        p = float(p_row[d])
        q = 1.0 if draft_probs is None else float(draft_probs[i, d])
        if float(accept_u[i]) * q < p:  # u < min(1, p / q)
            out.append(d)
            continue
        if draft_probs is None:
            residual = p_row.clone()
            residual[d] = 0.0
        else:
            residual = (p_row - draft_probs[i].double()).clamp_(min=0.0)  # [vocab]
            if not float(residual.sum()) > 0.0:  # p == q up to rounding, and u * q(d) >= p(d) by a hair
                residual = p_row.clone()
                residual[d] = 0.0  # never the rejected draft
        out.append(int(inverse_cdf_sample(residual.unsqueeze(0), residual_u[i : i + 1])[0]))
        return out
    out.append(int(inverse_cdf_sample(target_probs[k : k + 1].double(), residual_u[k : k + 1])[0]))
    return out


def greedy_verify(target_argmax: list[int], draft_ids: list[int]) -> list[int]:
    """Greedy verification: the draft's longest prefix equal to the target's argmax at each row,
    then the target's argmax at the first mismatch (or the bonus row). ``target_argmax``: k + 1 ids."""
    out: list[int] = []
    for want, d in zip(target_argmax, draft_ids):
        out.append(want)
        if want != d:
            return out
    out.append(target_argmax[len(draft_ids)])
    return out


@dataclass
class DraftGroup:
    """One sampled (temperature > 0) sequence verified against a draft model's proposals.

    ``first_row``: the index, among the rows handed to the sampler, of its first row (its last
    committed token; rows first_row .. first_row + k are its k + 1 rows); ``seq``: the sequence
    (row first_row's, whose ``len(token_ids)`` is the position of the first token drawn);
    ``draft_ids``: the k draft tokens; ``draft_probs``: [k, vocab] float32, the draft's q.
    """

    first_row: int
    seq: object
    draft_ids: list[int]
    draft_probs: torch.Tensor


def rejection_sample_batch(
    target_probs: torch.Tensor,
    draft_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    draft_probs: torch.Tensor,
    accept_u: torch.Tensor,
    residual_u: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rejection_sample`` for G sequences at once, as tensor ops on their device (no host sync),
    token for token the same (tests/spec_decode/test_spec_draft.py checks it against the loop).

    Args:
        target_probs: [G, K + 1, vocab] the target's probabilities; sequence g's rows 0..k_g
            (row k_g: its bonus row), the rest padding.
        draft_ids: [G, K] int64, sequence g's k_g drafts first (padding: any valid id).
        num_drafts: [G] int64, k_g >= 1.
        draft_probs: [G, K, vocab] the draft's q.
        accept_u: [G, K], residual_u: [G, K + 1] float64 draws.

    Returns (tokens [G, K + 1] int64: the first ``num_emitted[g]`` of row g are its emitted tokens,
    num_emitted [G] int64 in 1..k_g + 1).
    """
    G, K = draft_ids.shape
    device = target_probs.device
    p = target_probs.double()  # [G, K + 1, vocab]
    q = draft_probs.double()  # [G, K, vocab]
    pd = p[:, :K].gather(2, draft_ids.unsqueeze(2)).squeeze(2)  # [G, K] p_i(d_i)
    qd = q.gather(2, draft_ids.unsqueeze(2)).squeeze(2)  # [G, K] q_i(d_i)
    valid = torch.arange(K, device=device) < num_drafts.unsqueeze(1)  # [G, K]
    accept = (accept_u.to(device) * qd < pd) & valid  # [G, K]
    m = torch.cumprod(accept.long(), dim=1).sum(dim=1)  # [G]: drafts accepted before the first rejection
    g = torch.arange(G, device=device)
    rejected = m < num_drafts  # [G]
    mq = m.clamp(max=K - 1)
    p_m = p[g, m]  # [G, vocab]: the rejected row, or the bonus row
    residual = torch.where(rejected.unsqueeze(1), (p_m - q[g, mq]).clamp(min=0.0), p_m)  # [G, vocab]
    empty = rejected & ~(residual.sum(dim=1) > 0.0)  # p == q up to rounding (see rejection_sample)
    fallback = p_m.scatter(1, draft_ids[g, mq].unsqueeze(1), 0.0)
    residual = torch.where(empty.unsqueeze(1), fallback, residual)
    x = inverse_cdf_sample(residual, residual_u.to(device)[g, m])  # [G]
    tokens = torch.cat([draft_ids, draft_ids[:, :1]], dim=1)  # [G, K + 1]
    tokens[g, m] = x
    return tokens, m + 1


def resample_groups(groups: list[DraftGroup], draw_key: Callable, tokens: torch.Tensor, probs: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The sampler's hook (``Sampler.__call__(resample=...)``): the tokens of each group's k + 1
    rows replaced by the rejection sampler's (``rejection_sample_batch``): the emitted ones in its
    first 1..k + 1 rows; a row after the first rejection keeps any token (the verification keeps
    tokens only up to the first row that differs from its draft, and a recovered token never
    equals the rejected draft: the residual is 0 there). Draws: the accept draw of position L + i
    on stream ``stream ^ ACCEPT_STREAM``, the recovered or bonus one on ``stream ^
    RESIDUAL_STREAM`` (L: the group's first position). ``tokens`` [R] int64 and ``probs`` [R, vocab] float32 are the sampled
    rows ``rows``' (indices into the sampler's rows); ``draw_key(seq) -> (key, stream)``."""
    where = {row: j for j, row in enumerate(rows)}
    device = tokens.device
    K = max(len(g.draft_ids) for g in groups)
    index, drafts, ks, qs, keys, streams, positions = [], [], [], [], [], [], []
    for g in groups:
        k = len(g.draft_ids)
        first = where[g.first_row]
        index.append([where[g.first_row + i] for i in range(k + 1)] + [first] * (K - k))  # padding: any row
        drafts.append(g.draft_ids + [g.draft_ids[0]] * (K - k))
        ks.append(k)
        qs.append(torch.nn.functional.pad(g.draft_probs, (0, 0, 0, K - k)))  # [K, vocab]
        key, stream = draw_key(g.seq)
        keys.append(key)
        streams.append(stream)
        positions.append(len(g.seq.token_ids))  # of the token drawn at the group's first row
    n = len(groups)
    pos = [p + i for p in positions for i in range(K + 1)]  # [G * (K + 1)]
    rep = lambda values: [v for v in values for _ in range(K + 1)]  # noqa: E731
    accept_u = counter_uniforms(rep(keys), [as_int64(s ^ ACCEPT_STREAM) for s in rep(streams)], pos).view(n, K + 1)[:, :K]
    residual_u = counter_uniforms(rep(keys), [as_int64(s ^ RESIDUAL_STREAM) for s in rep(streams)], pos).view(n, K + 1)
    index_t = torch.tensor(index, dtype=torch.int64).to(device)  # [G, K + 1]
    out, emitted = rejection_sample_batch(
        probs[index_t],  # [G, K + 1, vocab]
        torch.tensor(drafts, dtype=torch.int64).to(device),  # [G, K]
        torch.tensor(ks, dtype=torch.int64).to(device),  # [G]
        torch.stack(qs).to(device),  # [G, K, vocab]
        accept_u, residual_u,
    )
    keep = torch.arange(K + 1, device=device) < emitted.unsqueeze(1)  # [G, K + 1]
    tokens = tokens.clone()
    tokens[index_t[keep]] = out[keep]
    return tokens
