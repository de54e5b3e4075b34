"""Token embedding, learned absolute position embedding and the lm_head.

``VocabParallelEmbedding`` and ``ParallelLMHead`` carry vLLM's names. Given a ``TPGroup`` of size
> 1 each rank holds ``ceil(vocab / tp)`` rows of the vocabulary, the last shard padded with zero
rows: the embedding looks up the ids in its range, zeroes the others and all-reduces (a sum of one
value and zeros: exact); the head computes its shard's logits and all-gathers them to the full
vocabulary on every rank (every rank samples the same tokens: the draws are counter-based). Without
a group each holds the whole matrix, as before.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedgen.distributed.group import TPGroup, tp_size
from pagedgen.layers.loading import check_shape, read
from pagedgen.layers.matmul import MatmulConfig, linear
from pagedgen.layers.module import Module


class VocabParallelEmbedding(Module):
    """Token embedding: ids [T] int64 -> [T, embedding_dim] (model dtype).

    Args:
        num_embeddings: vocabulary size (rows of ``weight`` [num_embeddings, embedding_dim]).
        embedding_dim: features per token.
        scale: multiplier applied after the lookup, rounded to the model dtype first (Gemma's
            sqrt(hidden_size), as transformers' ``GemmaTextScaledWordEmbedding``); 1.0: none.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, scale: float = 1.0, tp: Optional[TPGroup] = None) -> None:
        super().__init__()
        self.scale = scale
        self.tp = tp if tp_size(tp) > 1 else None
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        rows = num_embeddings
        if self.tp is not None:
            rows = -(-num_embeddings // self.tp.size)  # per rank; the last shard padded with zero rows
            self.vocab_start = self.tp.rank * rows
        self.rows_per_rank = rows
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim), requires_grad=False)
        if self.tp is not None:
            self.weight.weight_loader = vocab_weight_loader(self)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            x = F.embedding(input_ids, self.weight)  # [T, embedding_dim]
        else:
            local = input_ids - self.vocab_start
            outside = (local < 0) | (local >= self.rows_per_rank)  # [T]
            x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill_(outside.unsqueeze(1), 0)
            x = self.tp.comm.all_reduce(x)  # [T, embedding_dim]: one rank's row plus zeros, exact
        if self.scale != 1.0:
            x = x * torch.tensor(self.scale, dtype=torch.float32).to(x.dtype)
        return x


def vocab_weight_loader(layer):
    """The loader of a vocabulary-sharded [rows, ...] parameter: checks the global shape
    [num_embeddings, ...], reads rows ``[rank * rows, + rows)`` (fewer on the last rank) and zeroes
    the padding rows."""

    def load(param: nn.Parameter, loaded, shard_id=None) -> None:
        if shard_id is not None:
            raise ValueError(f"parameter of shape {tuple(param.shape)} has no shard {shard_id!r}")
        if not check_shape(loaded, (layer.num_embeddings,) + tuple(param.shape[1:])):
            return
        start = layer.tp.rank * layer.rows_per_rank
        n = max(0, min(layer.rows_per_rank, layer.num_embeddings - start))
        with torch.no_grad():
            param.zero_()
            if n:
                param.narrow(0, 0, n).copy_(read(loaded.narrow(0, start, n)))

    return load


class PositionEmbedding(Module):
    """Learned absolute position embedding (GPT-2's ``wpe``, OPT's ``embed_positions``): positions
    [T] int64 -> rows ``weight[position + offset]`` [T, embedding_dim].

    Args:
        num_positions: the model's context length (``max_position_embeddings``).
        embedding_dim: features per row.
        offset: rows before position 0 (OPT reserves 2, so its table has num_positions + 2 rows).
    """

    def __init__(self, num_positions: int, embedding_dim: int, offset: int = 0) -> None:
        super().__init__()
        self.offset = offset
        self.weight = nn.Parameter(torch.empty(num_positions + offset, embedding_dim), requires_grad=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(positions + self.offset if self.offset else positions, self.weight)


class ParallelLMHead(Module):
    """Logits of the rows to sample: [S, hidden] -> [S, vocab] in the model dtype (the matmul through
    ``linear``, rounded to the model dtype as transformers' is). Not converted to float32 here: a
    greedy step takes the argmax of these logits as they are (the same token: bf16/fp16 -> float32
    is exact and keeps the order), and the sampler converts only when it processes or samples
    (``Sampler``, logprobs, beams).

    Args:
        num_embeddings: vocabulary size; embedding_dim: features in.
        bias: whether the head has a bias [vocab].
        tie_to: a VocabParallelEmbedding whose weight the head shares (``tie_word_embeddings``);
            then the checkpoint need not (and usually does not) hold ``lm_head.weight``. A module
            without a weight (the embedding is on another pipeline stage: a placeholder) makes the
            head hold its own copy (``tied_elsewhere``), which the loader fills from the
            embedding's checkpoint tensor.
    """

    matmul: Optional[MatmulConfig] = None  # set by pagedgen.layers.matmul.prepare_matmuls

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False, tie_to: Optional[VocabParallelEmbedding] = None,
                 tp: Optional[TPGroup] = None) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.tp = tp if tp_size(tp) > 1 else None
        rows = num_embeddings if self.tp is None else -(-num_embeddings // self.tp.size)  # per rank
        self.rows_per_rank = rows
        self.tied = getattr(tie_to, "weight", None) is not None
        self.tied_elsewhere = tie_to is not None and not self.tied
        self.weight = tie_to.weight if self.tied else nn.Parameter(torch.empty(rows, embedding_dim), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(rows), requires_grad=False) if bias else None
        if self.tp is not None:
            for p in (self.weight, self.bias):
                if p is not None and not (self.tied and p is self.weight):
                    p.weight_loader = vocab_weight_loader(self)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return linear(hidden, self.weight, self.bias, self.matmul, self.num_embeddings)  # [S, vocab], model dtype
        local = linear(hidden, self.weight, self.bias, self.matmul, self.rows_per_rank)  # [S, vocab / tp] (padded)
        logits = self.tp.comm.all_gather(local)  # [S, tp * rows], rank order
        return logits if logits.shape[1] == self.num_embeddings else logits[:, : self.num_embeddings].contiguous()  # [S, vocab], every rank
