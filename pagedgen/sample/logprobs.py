"""Log-probabilities of chosen tokens plus the top k, as vLLM's ``Logprob`` dictionaries.

Convention (vLLM v1's default ``logprobs_mode="raw_logprobs"``): the log-softmax of the model's raw
logits, before penalties, logit bias, temperature and top-k/top-p/min-p. So logprobs do not change
with the sampling settings, and a prompt token's logprob at position i is log_softmax(logits at
position i - 1)[token i] (the model's prediction from the tokens before it).

At the cost of what is asked: a row's log-softmax is never materialised. One log-sum-exp per row
and the logits of the tokens asked for give ``logit - lse``: the chosen token's, and the top k's,
found on the logits themselves (the log-softmax is the logits shifted by one number per row: the
same order). On the CPU one kernel does it all (``ops.logprob_topk``, csrc/cpu/logprobs.cpp, for
up to ``ops.LOGPROB_TOPK_MAX`` = 20 top logprobs, vLLM's default max_logprobs): two passes over
each row in the logits' own dtype (bf16 read as it is), the first for the maximum, the rank count and
the top k (a sorted buffer of k entries that a block of logits enters only when one of them beats
its smallest), the second for the sum of exponentials; where the five passes of the PyTorch
reference it replaced (a float32 copy, ``logsumexp``, the rank count, ``topk``, the ties'
``nonzero``) made logprob requests cost 0.74x the throughput of the same requests without
(benchmarks/logprobs_cost.py, issue 50). Elsewhere (a GPU, more than 20 top logprobs) that
reference runs (``ops.reference.logprob_topk``). Prompt logprobs run over their rows in chunks of
``PROMPT_LOGPROB_CHUNK_ROWS`` (``chunked_logprob_tensors``): the lm_head's logits of a chunk, its
numbers, the next chunk; so a long prompt never holds [prompt_len, vocab] floats at once
(benchmarks/logprobs_cost.py measures it). The lm_head over the prompt rows is what prompt logprobs
cost beyond that: requests without them skip it.

Ranks follow vLLM: the chosen token's rank is the number of tokens at least as likely as it (1 for
the most likely), counted on the logits; the top-k tokens get ranks 1..k in order. Equal logits
(frequent with bf16) are ordered by token id, lowest first: ``torch.topk`` leaves the order of ties
to its algorithm, which may vary with the number of rows, and a row's logprobs must not depend on
the other rows of its step (docs/determinism.md). The kernel sums each row in a fixed order, so a
row's bits do not depend on the others either; its log-sum-exp is within about 1e-6 relative of
torch's (another order of the same sum).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from pagedgen import ops
from pagedgen.outputs import Logprob

#: prompt-logprob rows whose logits are held at once (and, off the CPU kernel, their float32 copy):
#: for a vocabulary of 49,152, 256 rows are 48 MiB of float32 logits, whatever the prompt's length
PROMPT_LOGPROB_CHUNK_ROWS = 256


def logprob_dicts(
    logits: torch.Tensor,  # [R, V] any float dtype, the raw logits
    token_ids: torch.Tensor,  # [R] int64, the chosen token of each row
    num_logprobs: list[int],  # R entries: top-k size of each row (0: only the chosen token)
) -> list[dict[int, Logprob]]:
    """One {token id: Logprob} per row: the chosen token first, then the row's top k. The tensors
    may live on any device: the work stays there and one copy brings the results to the host."""
    packed = logprob_tensors(logits, token_ids, max(num_logprobs, default=0))  # [R, 3 + 2k]
    return unpack_logprob_dicts(packed if packed.device.type == "cpu" else packed.cpu(), num_logprobs)


def logprob_tensors(logits: torch.Tensor, token_ids: torch.Tensor, k_max: int) -> torch.Tensor:
    """The numbers of ``logprob_dicts`` packed on the logits' device, for one copy to the host:
    [R, 3 + 2 * k_max] float64 = (chosen id, its logprob, its rank, the top k_max logprobs, their
    ids). float64 holds float32 values and token ids (< 2**53) exactly. ``logits``: [R, V] raw
    logits, float32, bfloat16 or float16 (the last dim contiguous); ``token_ids``: [R] int64 in
    [0, V); 0 <= k_max <= V. Each logprob is ``logit - logsumexp(row)`` in float32; no [R, V]
    log-softmax is made. Through ``ops.logprob_topk``: on the CPU one kernel, two passes over each
    row in the logits' own dtype (k_max up to ``ops.LOGPROB_TOPK_MAX``); elsewhere its PyTorch
    reference. Raises RuntimeError (the kernel) on a token id outside [0, V)."""
    out = torch.empty(logits.shape[0], 3 + 2 * k_max, dtype=torch.float64, device=logits.device)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    ops.logprob_topk(out, logits, token_ids, k_max)
    return out


def chunked_logprob_tensors(
    hidden: torch.Tensor,  # [R, hidden] model dtype: the final hidden rows (before the lm_head)
    compute_logits: Callable[[torch.Tensor], torch.Tensor],  # [n, hidden] -> [n, V] (the model's lm_head)
    token_ids: torch.Tensor,  # [R] int64, the chosen token of each row
    k_max: int,
    chunk_rows: Optional[int] = None,  # None: PROMPT_LOGPROB_CHUNK_ROWS
) -> torch.Tensor:
    """``logprob_tensors`` of ``compute_logits(hidden)`` [R, 3 + 2 * k_max] float64, computed
    ``chunk_rows`` rows at a time: at most [chunk_rows, V] logits are held at once. Every rank of a tensor-parallel group calls it with the same rows (``compute_logits``
    may gather across ranks). A row's numbers do not depend on the chunk it falls in (the lm_head's
    GEMM and the reductions are per row: docs/determinism.md)."""
    chunk_rows = chunk_rows or PROMPT_LOGPROB_CHUNK_ROWS
    parts = [
        logprob_tensors(compute_logits(hidden[i : i + chunk_rows]), token_ids[i : i + chunk_rows], k_max)
        for i in range(0, hidden.shape[0], chunk_rows)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


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
