"""CUDA graphs for decode steps: a step of B decode tokens replays a graph captured once for the
smallest captured batch size >= B, instead of launching every kernel of the forward pass again.

Captured: embedding, every layer (projections, RoPE, ``reshape_and_cache``, ``paged_attention``),
final norm and lm_head, for static input buffers. Before a replay the step's inputs are copied into
those buffers; rows past B are padding: slot -1 (nothing written), seq_len 0 (a row at position -1:
attention output 0), and their logits are ignored. A decode step has one row per sequence, so
``query_start_loc`` is 0, 1, ..., b for every replay (a constant buffer). The block-table width is
fixed to ``max_blocks_per_seq`` (max_model_len / block_size), so every replay plans attention for the
longest possible context.
Sampling stays outside the graph.
"""
from __future__ import annotations

import logging

import torch

from pagedgen.model.llama import LlamaForCausalLM
from pagedgen.ops import AttentionMetadata

logger = logging.getLogger("pagedgen")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_num_seqs`` (vLLM's choice of sizes)."""
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class CUDAGraphRunner:
    """Captures and replays decode steps of ``model`` over ``kv_caches``.

    Args:
        model: the model, on a CUDA device.
        kv_caches: the per-layer (key_cache, value_cache) pairs the graphs read and write.
        max_num_seqs: the largest decode batch to capture.
        max_blocks_per_seq: width of the captured block tables.
    """

    def __init__(self, model: LlamaForCausalLM, kv_caches, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = kv_caches[0][0].shape[1] if kv_caches else 1
        self.sizes = capture_sizes(max_num_seqs)
        self.max_blocks = max_blocks_per_seq
        dev = model.device
        n = self.sizes[-1]
        # static inputs, shared by all graphs (a smaller graph reads a prefix of each)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)  # [n]
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)  # [n]
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)  # [n]
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=dev)  # [n, max_blocks]
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)  # [n]
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)  # [n + 1], never changes
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=dev)  # [n]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # logits [b, vocab] (model dtype) per captured size
        self._pool = None

    def _forward(self, b: int) -> torch.Tensor:
        attn = AttentionMetadata(
            self.slot_mapping[:b], self.block_tables[:b], self.seq_lens[:b], self.query_start_loc[: b + 1],
            max_seq_len=self.max_blocks * self.block_size,
        )
        return self.model.forward(self.input_ids[:b], self.positions[:b], attn, self.kv_caches, self.logits_indices[:b])

    def capture(self) -> None:
        """Capture one graph per size, largest first (they share one memory pool)."""
        torch.cuda.synchronize()
        for b in reversed(self.sizes):
            for _ in range(2):  # warm-up outside the graph (lazy inits, autotuning)
                self._forward(b)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self.outputs[b] = self._forward(b)
            if self._pool is None:
                self._pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize()

    def can_run(self, num_tokens: int, num_seqs: int, max_blocks: int) -> bool:
        """True for a pure decode step (one token per sequence) that a captured graph covers."""
        return num_tokens == num_seqs and num_tokens <= self.sizes[-1] and max_blocks <= self.max_blocks and bool(self.graphs)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        """Replay for B decode tokens (inputs on the device, B <= max size). Returns logits [B, vocab]."""
        b_real = input_ids.shape[0]
        b = next(s for s in self.sizes if s >= b_real)
        width = attn.block_tables.shape[1]
        self.input_ids[:b_real].copy_(input_ids)
        self.positions[:b_real].copy_(positions)
        self.slot_mapping[:b_real].copy_(attn.slot_mapping)
        self.slot_mapping[b_real:b].fill_(-1)
        self.block_tables[:b_real, :width].copy_(attn.block_tables)
        self.seq_lens[:b_real].copy_(attn.seq_lens)
        self.seq_lens[b_real:b].fill_(0)
        self.graphs[b].replay()
        return self.outputs[b][:b_real]
