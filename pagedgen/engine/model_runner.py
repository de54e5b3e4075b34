"""Builds the tensors of one step and runs the model on them; owns the KV cache.

KV cache layout: one (key_cache, value_cache) pair per layer, each
    [num_blocks, block_size, num_kv_heads, head_dim]   (model dtype)
so one block of one layer holds ``block_size`` consecutive tokens of one sequence, all KV heads.
Physical block b of every layer belongs to the same sequence: the block manager's block ids index
all layers at once.

One step's inputs, for the scheduled sequences s_0..s_{n-1} computing tokens [c_i, c_i + k_i):
    input_ids    [T]            the tokens, sequence after sequence (T = sum k_i)
    positions    [T]            c_i .. c_i + k_i - 1
    slot_mapping [T]            block_table[p // block_size] * block_size + p % block_size
    block_tables [T, max_blocks] each token's sequence's block table (padded with 0, never read)
    seq_lens     [T]            position + 1: each token attends over itself and all before it
    logits_indices [S]          the last token of each sequence that samples this step
"""
from __future__ import annotations

import torch

from pagedgen import ops
from pagedgen.config import CacheConfig
from pagedgen.engine.block_manager import BlockManager
from pagedgen.engine.sampler import Sampler
from pagedgen.engine.scheduler import SchedulerOutput
from pagedgen.engine.sequence import Sequence
from pagedgen.model.llama import AttentionMetadata, LlamaForCausalLM


class ModelRunner:
    """Runs scheduled steps of ``model`` over a paged KV cache of ``cache_config``'s size.

    Args:
        model: the loaded model (its config gives layers, KV heads, head size and dtype).
        cache_config: block size and number of blocks.
        sampler: picks the next tokens from the logits.
    """

    def __init__(self, model: LlamaForCausalLM, cache_config: CacheConfig, sampler: Sampler) -> None:
        self.model = model
        self.cache_config = cache_config
        self.sampler = sampler
        cfg = model.config
        shape = (cache_config.num_blocks, cache_config.block_size, cfg.num_kv_heads, cfg.head_dim)
        # torch.empty: pages are only touched when a block is first written
        self.kv_caches = [
            (torch.empty(shape, dtype=cfg.dtype, device=model.device), torch.empty(shape, dtype=cfg.dtype, device=model.device))
            for _ in range(cfg.num_layers)
        ]
        # CPU swap space for swap preemption, same layout: [num_cpu_blocks, block_size, num_kv_heads, head_dim]
        cpu_shape = (cache_config.num_cpu_blocks,) + shape[1:]
        pin = model.device.type == "cuda"
        self.cpu_caches = [
            (torch.empty(cpu_shape, dtype=cfg.dtype, pin_memory=pin), torch.empty(cpu_shape, dtype=cfg.dtype, pin_memory=pin))
            for _ in range(cfg.num_layers if cache_config.num_cpu_blocks else 0)
        ]

    def kv_cache_bytes(self) -> int:
        """Bytes held by the KV cache of all layers."""
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.kv_caches)

    def prepare(self, batch: SchedulerOutput, block_manager: BlockManager):
        """Host-side lists -> the step's tensors (see the module docstring). Also returns the
        sequences that sample a token this step, in ``logits_indices`` order."""
        bs = self.cache_config.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        token_rows: list[int] = []
        tables: list[list[int]] = []
        logits_indices: list[int] = []
        sampling: list[Sequence] = []
        for row, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start = seq.num_computed_tokens
            end = start + n
            table = block_manager.block_table(seq.seq_id)
            tables.append(table)
            if n == 1:
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
                token_rows.append(row)
            else:
                input_ids.extend(seq.token_ids[start:end])
                positions.extend(range(start, end))
                slots.extend([table[p // bs] * bs + p % bs for p in range(start, end)])
                token_rows.extend([row] * n)
            if end == seq.num_tokens:
                logits_indices.append(len(input_ids) - 1)
                sampling.append(seq)
        max_blocks = max(len(t) for t in tables)
        padded = [t + [0] * (max_blocks - len(t)) for t in tables]
        device = self.model.device
        positions_t = torch.tensor(positions, dtype=torch.int64)
        block_tables = torch.tensor(padded, dtype=torch.int32)
        if len(token_rows) != len(padded):
            block_tables = block_tables[torch.tensor(token_rows, dtype=torch.int64)]
        attn = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device, non_blocking=True),
            block_tables=block_tables.to(device, non_blocking=True),
            seq_lens=(positions_t + 1).to(torch.int32).to(device, non_blocking=True),
        )
        tensors = (
            torch.tensor(input_ids, dtype=torch.int64).to(device, non_blocking=True),
            positions_t.to(device, non_blocking=True),
            attn,
            torch.tensor(logits_indices, dtype=torch.int64).to(device, non_blocking=True),
        )
        return tensors, sampling

    def move_blocks(self, batch: SchedulerOutput) -> None:
        """Swap out, swap in, then copy-on-write copies, in every layer (before the step's forward:
        a block freed by a swap-out may be written by this very step)."""
        for pairs, direction in ((batch.blocks_to_swap_out, "out"), (batch.blocks_to_swap_in, "in")):
            if not pairs:
                continue
            mapping = torch.tensor(pairs, dtype=torch.int64)  # [N, 2] (src, dst)
            for (k, v), (ck, cv) in zip(self.kv_caches, self.cpu_caches):
                if direction == "out":
                    ops.swap_blocks(k, ck, mapping)
                    ops.swap_blocks(v, cv, mapping)
                else:
                    ops.swap_blocks(ck, k, mapping)
                    ops.swap_blocks(cv, v, mapping)
        if batch.blocks_to_copy:
            mapping = torch.tensor(batch.blocks_to_copy, dtype=torch.int64).to(self.model.device)  # [N, 2]
            for k, v in self.kv_caches:
                ops.copy_blocks(k, v, mapping)

    def execute(self, batch: SchedulerOutput, block_manager: BlockManager) -> tuple[list[Sequence], list[int]]:
        """Run one step. Returns the sequences that sampled and their new token ids (same order)."""
        self.move_blocks(batch)
        (input_ids, positions, attn, logits_indices), sampling = self.prepare(batch, block_manager)
        logits = self.model.forward(input_ids, positions, attn, self.kv_caches, logits_indices)
        if not sampling:
            return [], []
        return sampling, self.sampler(logits.cpu(), sampling)
