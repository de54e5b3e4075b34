"""Builds the tensors of one step and runs the model on them; owns the KV cache.

KV cache layout: one (key_cache, value_cache) pair per layer, each
    [num_blocks, block_size, num_kv_heads, head_dim]   (model dtype)
so one block of one layer holds ``block_size`` consecutive tokens of one sequence, all KV heads.
Physical block b of every layer belongs to the same sequence: the block manager's block ids index
all layers at once.

One step's inputs, for the scheduled sequences s_0..s_{n-1} computing tokens [c_i, c_i + k_i):
    input_ids    [T]            the tokens, sequence after sequence (T = sum k_i)
    positions    [T]            c_i .. c_i + k_i - 1
    attn (pagedgen.ops.AttentionMetadata):
      slot_mapping [T]          block_table[p // block_size] * block_size + p % block_size
      block_tables [n, max_blocks] each sequence's block table (padded with 0, never read)
      seq_lens     [n]          c_i + k_i: the context of sequence i after this step
      query_start_loc [n + 1]   0, k_0, k_0 + k_1, ...: sequence i's rows of the step
      max_seq_len               max(c_i + k_i)
    logits_indices [S + B + R]  the last token of each of the S sequences that sample this step
                                (a forked parallel sample repeats its parent's row), of the B beams,
                                then the R prompt positions whose logits give prompt logprobs

Prompt logprobs: a sequence that asks for them gets logits at every prompt position p it computes
in this step with p + 1 < prompt length, since position p predicts prompt token p + 1 (the first
prompt token has no logprob). Prefill chunks fill them in order; positions already recorded (a
recompute after preemption) are not computed twice.
"""
from __future__ import annotations

import warnings
from array import array
from dataclasses import dataclass, field
from typing import Optional

import torch

from pagedgen import ops
from pagedgen.config import CacheConfig
from pagedgen.engine.block_manager import BlockManager
from pagedgen.engine.cuda_graphs import CUDAGraphRunner
from pagedgen.engine.logprobs import logprob_dicts
from pagedgen.engine.sampler import Sampler
from pagedgen.engine.scheduler_output import ScheduledBatch
from pagedgen.engine.sequence import Sequence
from pagedgen.model.llama import LlamaForCausalLM
from pagedgen.ops import AttentionMetadata
from pagedgen.outputs import Logprob


_TYPECODES = {torch.int64: "q", torch.int32: "i"}


def _int_tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A 1-D CPU tensor of Python ints, through ``array`` (several times faster than ``torch.tensor``
    on a list: the ints are converted in one C loop)."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array(_TYPECODES[dtype], values), dtype=dtype)


def _padded_int32(rows: list[list[int]]) -> torch.Tensor:
    """[len(rows), longest row] int32, each row padded with 0 (rows must not all be empty)."""
    width = max(map(len, rows))
    zeros = [0] * width
    flat: list[int] = []
    for row in rows:
        flat += row
        flat += zeros[len(row) :]
    return _int_tensor(flat, torch.int32).view(len(rows), width)


@dataclass
class PromptLogprobsPlan:
    """The prompt positions of one step whose logits give prompt logprobs.

    ``seqs[i]`` gets ``num_rows[i]`` rows for positions ``first_positions[i] ..``; row r predicts
    ``target_ids[r]`` (the next prompt token) and keeps ``num_logprobs[r]`` top tokens.
    """

    rows: list[int] = field(default_factory=list)  # flat token index of each row in the step
    target_ids: list[int] = field(default_factory=list)
    num_logprobs: list[int] = field(default_factory=list)
    seqs: list[Sequence] = field(default_factory=list)
    first_positions: list[int] = field(default_factory=list)
    num_rows: list[int] = field(default_factory=list)

    def add(self, seq: Sequence, start: int, end: int, base: int) -> None:
        """``seq`` computes positions [start, end), the first at flat index ``base``."""
        first = max(start, len(seq.prompt_logprobs) - 1)
        last = min(end, seq.num_prompt_tokens - 1)  # exclusive
        if last <= first:
            return
        self.rows.extend(range(base + first - start, base + last - start))
        self.target_ids.extend(seq.token_ids[first + 1 : last + 1])
        self.num_logprobs.extend([seq.sampling_params.prompt_logprobs] * (last - first))
        self.seqs.append(seq)
        self.first_positions.append(first)
        self.num_rows.append(last - first)


@dataclass
class StepOutput:
    """What one model step produced.

    Attributes:
        seqs: the sequences that sampled a token, and ``token_ids`` their new tokens (same order).
        logprobs: None when no sequence asked, else per sampled sequence {token id: Logprob} or None.
        prompt_logprobs: (sequence, first position, entries) for prompt logprobs computed this step.
        beam_logprobs: (beam sequence, log-softmax of its logits [vocab] float32) for beam-search
            sequences, which are not sampled: their group picks the next tokens.
    """

    seqs: list[Sequence]
    token_ids: list[int]
    logprobs: Optional[list[Optional[dict[int, Logprob]]]] = None
    prompt_logprobs: list[tuple[Sequence, int, list[dict[int, Logprob]]]] = field(default_factory=list)
    beam_logprobs: list[tuple[Sequence, torch.Tensor]] = field(default_factory=list)


class ModelRunner:
    """Runs scheduled steps of ``model`` over a paged KV cache of ``cache_config``'s size.

    Args:
        model: the loaded model (its config gives layers, KV heads, head size and dtype).
        cache_config: block size and number of blocks.
        sampler: picks the next tokens from the logits.
        cuda_graph_max_seqs: on a GPU, capture decode steps of up to this many sequences in CUDA
            graphs (0: run every step eagerly).
        max_model_len: tokens per sequence at most (sets the captured block-table width).
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        cache_config: CacheConfig,
        sampler: Sampler,
        cuda_graph_max_seqs: int = 0,
        max_model_len: int = 0,
    ) -> None:
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
        self.on_cpu = model.device.type == "cpu"
        self.graphs: Optional[CUDAGraphRunner] = None
        if cuda_graph_max_seqs and model.device.type == "cuda":
            graphs = CUDAGraphRunner(model, self.kv_caches, cuda_graph_max_seqs, -(-max_model_len // cache_config.block_size))
            try:
                graphs.capture()
                self.graphs = graphs
            except RuntimeError as exc:  # run eagerly rather than not at all
                warnings.warn(f"CUDA graph capture failed, decode steps run eagerly: {exc}", RuntimeWarning)

    def prepare(self, batch: ScheduledBatch, block_manager: BlockManager):
        """Host-side lists -> the step's tensors (see the module docstring). Also returns the
        sequences that sample a token this step, in ``logits_indices`` order, and the prompt
        positions whose logits are wanted for prompt logprobs (after those in ``logits_indices``)."""
        bs = self.cache_config.block_size
        block_table = block_manager.block_table
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        seq_lens: list[int] = []
        query_start_loc: list[int] = [0]
        logits_indices: list[int] = []
        sampling: list[Sequence] = []
        beam_rows: list[int] = []
        beams: list[Sequence] = []
        prompt_plan = PromptLogprobsPlan()
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            end = start + n
            token_ids = seq.token_ids
            table = block_table(seq.seq_id)
            tables.append(table)
            seq_lens.append(end)
            if seq.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
                prompt_plan.add(seq, start, end, len(input_ids))
            if n == 1:
                input_ids.append(token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                input_ids.extend(token_ids[start:end])
                positions.extend(range(start, end))
                slots.extend([table[p // bs] * bs + p % bs for p in range(start, end)])
            query_start_loc.append(len(input_ids))
            if end == len(token_ids):
                if seq.beam_group is not None:
                    beam_rows.append(len(input_ids) - 1)
                    beams.append(seq)
                else:
                    logits_indices.append(len(input_ids) - 1)
                    sampling.append(seq)
        for child, parent in batch.forked:  # parallel samples share their parent's last row
            logits_indices.append(logits_indices[sampling.index(parent)])
            sampling.append(child)
        attn = AttentionMetadata(
            slot_mapping=self._to_device(_int_tensor(slots, torch.int64)),  # [T]
            block_tables=self._to_device(_padded_int32(tables)),  # [n, max_blocks]
            seq_lens=self._to_device(_int_tensor(seq_lens, torch.int32)),  # [n]
            query_start_loc=self._to_device(_int_tensor(query_start_loc, torch.int32)),  # [n + 1]
            max_seq_len=max(seq_lens),
        )
        tensors = (
            self._to_device(_int_tensor(input_ids, torch.int64)),
            self._to_device(_int_tensor(positions, torch.int64)),
            attn,
            self._to_device(_int_tensor(logits_indices + beam_rows + prompt_plan.rows, torch.int64)),
        )
        return tensors, sampling, beams, prompt_plan

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A host-built input on the model's device (skipped on the CPU, where it is already)."""
        return t if self.on_cpu else t.to(self.model.device, non_blocking=True)

    def move_blocks(self, batch: ScheduledBatch) -> None:
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

    def execute(self, batch: ScheduledBatch, block_manager: BlockManager) -> StepOutput:
        """Run one step: the sampled sequences' new tokens, logprobs and prompt logprobs."""
        self.move_blocks(batch)
        (input_ids, positions, attn, logits_indices), sampling, beams, prompt_plan = self.prepare(batch, block_manager)
        if self.graphs is not None and self.graphs.can_run(input_ids.shape[0], len(batch.seqs), attn.block_tables.shape[1]):
            logits = self.graphs.run(input_ids, positions, attn)[logits_indices].cpu()  # pure decode step
        else:
            logits = self.model.forward(input_ids, positions, attn, self.kv_caches, logits_indices).cpu()  # [S + B + R, vocab]
        num_sampling, num_beams = len(sampling), len(beams)
        out = StepOutput(sampling, [])
        if sampling:
            sampled = self.sampler(logits[:num_sampling], sampling)
            out.token_ids, out.logprobs = sampled.token_ids, sampled.logprobs
        if beams:
            beam_logprobs = logits[num_sampling : num_sampling + num_beams].log_softmax(dim=-1)  # [B, vocab]
            out.beam_logprobs = list(zip(beams, beam_logprobs))
        if prompt_plan.rows:
            dicts = logprob_dicts(
                logits[num_sampling + num_beams :].log_softmax(dim=-1),
                torch.tensor(prompt_plan.target_ids, dtype=torch.int64),
                prompt_plan.num_logprobs,
            )
            offset = 0
            for seq, first, count in zip(prompt_plan.seqs, prompt_plan.first_positions, prompt_plan.num_rows):
                out.prompt_logprobs.append((seq, first, dicts[offset : offset + count]))
                offset += count
        return out
