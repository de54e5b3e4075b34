"""Token embedding, learned absolute position embedding and the lm_head.

``VocabParallelEmbedding`` and ``ParallelLMHead`` carry vLLM's names: a tensor-parallel split would
divide the vocabulary rows across ranks here (a masked lookup plus an all-reduce for the embedding,
a gather of the logits for the head). One device today: each holds the whole matrix.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

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

    def __init__(self, num_embeddings: int, embedding_dim: int, scale: float = 1.0) -> None:
        super().__init__()
        self.scale = scale
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(input_ids, self.weight)  # [T, embedding_dim]
        if self.scale != 1.0:
            x = x * torch.tensor(self.scale, dtype=torch.float32).to(x.dtype)
        return x


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
            then the checkpoint need not (and usually does not) hold ``lm_head.weight``.
    """

    matmul: Optional[MatmulConfig] = None  # set by pagedgen.layers.matmul.prepare_matmuls

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False, tie_to: Optional[VocabParallelEmbedding] = None) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.tied = tie_to is not None
        self.weight = tie_to.weight if tie_to is not None else nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(num_embeddings), requires_grad=False) if bias else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.weight, self.bias, self.matmul, self.num_embeddings)  # [S, vocab], model dtype
