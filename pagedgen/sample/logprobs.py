"""Log-probabilities of chosen tokens plus the top k, as vLLM's ``Logprob`` dictionaries.

Convention (vLLM v1's default ``logprobs_mode="raw_logprobs"``): the log-softmax of the model's raw
logits, before penalties, logit bias, temperature and top-k/top-p/min-p. So logprobs do not change
with the sampling settings, and a prompt token's logprob at position i is log_softmax(logits at
position i - 1)[token i] (the model's prediction from the tokens before it).

Ranks follow vLLM: the chosen token's rank is the number of tokens at least as likely as it (1 for
the most likely); the top-k tokens get ranks 1..k in order. Equal logprobs (frequent with bf16
logits) are ordered by token id, lowest first: ``torch.topk`` leaves the order of ties to its
algorithm, which may vary with the number of rows, and a row's logprobs must not depend on the
other rows of its step (docs/determinism.md).
"""
from __future__ import annotations

import torch

from pagedgen.outputs import Logprob


def logprob_dicts(
    logprobs: torch.Tensor,  # [R, V] float32, log-softmax of the raw logits
    token_ids: torch.Tensor,  # [R] int64, the chosen token of each row
    num_logprobs: list[int],  # R entries: top-k size of each row (0: only the chosen token)
) -> list[dict[int, Logprob]]:
    """One {token id: Logprob} per row: the chosen token first, then the row's top k. The tensors
    may live on any device: the work stays there and one copy brings the results to the host."""
    packed = logprob_tensors(logprobs, token_ids, max(num_logprobs, default=0))  # [R, 2 + 2k]
    return unpack_logprob_dicts(packed if packed.device.type == "cpu" else packed.cpu(), num_logprobs)


def logprob_tensors(logprobs: torch.Tensor, token_ids: torch.Tensor, k_max: int) -> torch.Tensor:
    """The numbers of ``logprob_dicts`` packed on the logits' device, for one copy to the host:
    [R, 3 + 2 * k_max] float64 = (chosen id, its logprob, its rank, the top k_max logprobs, their
    ids). float64 holds float32 values and token ids (< 2**53) exactly. ``logprobs``: [R, V]
    float32; ``token_ids``: [R] int64."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [R, 1]
    ranks = (logprobs >= chosen).sum(dim=-1, keepdim=True)  # [R, 1]
    parts = [token_ids.unsqueeze(1).double(), chosen.double(), ranks.double()]
    if k_max:
        top_lp, top_ids = top_logprobs(logprobs, k_max)  # [R, k_max], descending
        parts += [top_lp.double(), top_ids.double()]
    return torch.cat(parts, dim=1)


def unpack_logprob_dicts(packed: torch.Tensor, num_logprobs: list[int]) -> list[dict[int, Logprob]]:
    """``packed`` [R, 3 + 2 * k_max] float64 on the host (``logprob_tensors``) as one
    {token id: Logprob} per row: the chosen token first, then the row's top ``num_logprobs[r]``."""
    k_max = (packed.shape[1] - 3) // 2
    out = []
    for row, k in zip(packed.tolist(), num_logprobs):
        d = {int(row[0]): Logprob(row[1], int(row[2]))}
        for j in range(k):
            d[int(row[3 + k_max + j])] = Logprob(row[3 + j], j + 1)
        out.append(d)
    return out


def top_logprobs(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries of each row: (values [R, k], token ids [R, k] int64), by value descending
    and, among equal values, by token id ascending (whatever the other rows). ``logprobs``: [R, V]
    float32, 1 <= k <= V."""
    values = logprobs.topk(k, dim=-1).values  # [R, k]: the k largest values themselves are exact
    rows, ids = (logprobs >= values[:, -1:]).nonzero(as_tuple=True)  # candidates, row-major: ids ascending
    counts = torch.bincount(rows, minlength=logprobs.shape[0])  # [R], >= k unless a row holds NaN
    # NOTE: nonzero above already waits for the device; this test adds no further sync
    if bool((counts < k).any()):
        return logprobs.topk(k, dim=-1)
    cand = logprobs[rows, ids]
    order = cand.sort(descending=True, stable=True).indices  # by value; stable: ids ascending among ties
    order = order[rows[order].sort(stable=True).indices]  # then by row, keeping that order within rows
    starts = counts.cumsum(0) - counts  # [R]: each row's first candidate
    take = order[(starts.unsqueeze(1) + torch.arange(k, device=logprobs.device)).view(-1)].view(-1, k)  # [R, k]
    return cand[take], ids[take]
