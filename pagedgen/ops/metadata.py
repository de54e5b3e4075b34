"""The per-step inputs of the attention op, built by the model runner and passed unchanged through
the model's attention layers to :func:`pagedgen.ops.paged_attention`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class AttentionMetadata:
    """Where one step's tokens go in the paged KV cache and what each attends to.

    A step holds S sequences; sequence s computes its tokens ``[seq_lens[s] - q_len, seq_lens[s])``
    (a prefill chunk, or q_len = 1 for a decode token), which are rows ``query_start_loc[s] ..
    query_start_loc[s + 1] - 1`` of the step's T flattened tokens. Each row attends causally over
    its sequence's cached tokens up to and including itself (a layer with a sliding window passes its
    own window to the op; the metadata is the same for all layers).

    Attributes:
        slot_mapping: [T] int64, KV slot of each token (block * block_size + offset; < 0 = padding,
            not written).
        block_tables: [S, max_blocks] int32, each sequence's block table (entries past its blocks
            are padding and never read).
        seq_lens: [S] int32, each sequence's context length after this step (cached + new tokens).
        query_start_loc: [S + 1] int32, 0, then the cumulative number of new tokens per sequence.
        max_seq_len: the largest of ``seq_lens`` (host int, so that no device value is read).
        kv_gather: with the 1-byte KV cache where its attention kernel is not built (the copy path),
            the blocks the step reads and its renumbered tables
            (``kv_quant.gather_plan``), made by the first layer and reused by the others; None before.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_seq_len: int
    kv_gather: Optional[tuple[torch.Tensor, torch.Tensor]] = None
