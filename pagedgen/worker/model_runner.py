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

Pipeline parallelism (``pp``, a ``PPGroup``): the runner of a stage holds the KV cache of the
stage's layers only and runs each step as micro-batches (worker/microbatch.py): every stage
prepares the same inputs (the block tables are every stage's), the first embeds the tokens, the
others receive the previous stage's activations, every stage but the last sends its own on, and
the last samples each micro-batch; the other stages return an empty output.

Prompt logprobs: a sequence that asks for them gets logits at every prompt position p it computes
in this step with p + 1 < prompt length, since position p predicts prompt token p + 1 (the first
prompt token has no logprob). Prefill chunks fill them in order; positions already recorded (a
recompute after preemption) are not computed twice.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from functools import partial
from itertools import accumulate, chain
from typing import Optional

import torch

from pagedgen import ops
from pagedgen.config import CacheConfig
from pagedgen.core.scheduler_output import ScheduledBatch
from pagedgen.core.sequence import Sequence
from pagedgen.model.llama import LlamaForCausalLM
from pagedgen.ops import AttentionMetadata, kv_quant
from pagedgen.outputs import Logprob
from pagedgen.sample.logprobs import chunked_logprob_tensors, unpack_logprob_dicts
from pagedgen.sample.rejection_sampler import DraftGroup, resample_groups
from pagedgen.sample.sampler import Sampler
from pagedgen.spec_decode import verify
from pagedgen.spec_decode.draft_model import DraftModelProposer
from pagedgen.worker import microbatch
from pagedgen.worker.block_tables import BlockTables, int_tensor
from pagedgen.worker.cuda_graphs import CUDAGraphRunner
from pagedgen.worker.pooler import PoolingRunner
from pagedgen.worker.prefault import Prefaulter
from pagedgen.worker.step_buffers import StepBuffers

# Steps of at most this many query rows (decode and speculative verify rows) build their positions
# and row indices as Python lists: cheaper than the tensor ops a long prefill needs (measured: a
# verify step of 8 sequences x 4 rows, ~20 us less a step).
_FEW_TOKENS = 256


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
    # speculative decoding: (sequence, tokens sampled after its first, their logprobs, drafts) for
    # each sequence verified this step (pagedgen/spec_decode/verify.py)
    spec: list = field(default_factory=list)
    # pooling models: (sequence, its result: a float32 CPU tensor) for each prompt done this step (worker/pooler.py)
    pooled: list = field(default_factory=list)


class ModelRunner:
    """Runs scheduled steps of ``model`` over a paged KV cache of ``cache_config``'s size.

    Args:
        model: the loaded model (its config gives layers, KV heads, head size and dtype).
        cache_config: block size and number of blocks.
        sampler: picks the next tokens from the logits.
        cuda_graph_max_seqs: on a GPU, capture decode steps of up to this many sequences in CUDA
            graphs (0: run every step eagerly).
        max_model_len: tokens per sequence at most (sets the captured block-table width).
        pp: this rank's pipeline stage (None: the whole model); its layers' KV cache only, the
            step in micro-batches (see the module docstring).
        draft_model: speculative decoding's draft model (method "draft_model"), run beside the
            model with a KV cache of the same blocks (spec_decode/draft_model.py); None without one.
        pooling: run a pooling model (``LLM(runner="pooling")``): every sequence's final hidden
            states are pooled (worker/pooler.py) instead of sampled.
        lora: a ``LoRAManager`` (pagedgen/lora/manager.py) when LoRA is on: before each forward it
            loads the step's adapters into their slots and gives each row its adapter's slot.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        cache_config: CacheConfig,
        sampler: Sampler,
        cuda_graph_max_seqs: int = 0,
        max_model_len: int = 0,
        pp=None,
        draft_model=None,
        pooling: bool = False,
        lora=None,
    ) -> None:
        self.model = model
        self.lora = lora
        self.pooler = PoolingRunner() if pooling else None
        self.pp = pp if pp is not None and pp.size > 1 else None
        self.cache_config = cache_config
        self.sampler = sampler
        cfg = model.config
        # per layer (key_cache, value_cache) [num_blocks, block_size, num_kv_heads, head_dim], and with a
        # 1-byte cache_dtype their scales (ops/kv_quant.py); torch.empty: a block's pages are backed when it
        # is first used (on the CPU: self.prefaulter)
        layout = (cache_config.block_size, cfg.num_kv_heads, cfg.head_dim, cfg.dtype)
        self.kv_caches = [
            kv_quant.allocate(cache_config.cache_dtype, cache_config.num_blocks, *layout, model.device)
            for _ in range(0 if getattr(model, "is_encoder", False) else cfg.num_layers)  # an encoder (model/bert.py) keeps no keys and values
        ]
        # CPU swap space for swap preemption, same layout: [num_cpu_blocks, block_size, num_kv_heads, head_dim]
        pin = model.device.type == "cuda"
        self.cpu_caches = [
            kv_quant.allocate(cache_config.cache_dtype, cache_config.num_cpu_blocks, *layout, "cpu", pin_memory=pin)
            for _ in range(cfg.num_layers if cache_config.num_cpu_blocks else 0)
        ]
        self.on_cpu = model.device.type == "cpu"
        # speculative decoding with a draft model: its KV cache has the same block ids (spec_decode/draft_model.py)
        self.drafter = None if draft_model is None else DraftModelProposer(draft_model, cache_config, sampler)
        # CPU: the pages of never-used blocks are faulted in bulk before a step writes them (prefault.py)
        block_bytes = cfg.kv_bytes_per_token(cache_config.cache_dtype) * cache_config.block_size
        touched = self.kv_caches
        if self.drafter is not None:
            block_bytes += draft_model.config.kv_bytes_per_token() * cache_config.block_size
            touched = touched + self.drafter.kv_caches
        self.prefaulter = Prefaulter(touched, block_bytes) if self.on_cpu and touched else None
        # persistent block tables, updated from each step's deltas: [rows, ceil(max_model_len / block_size)] int32
        self.buffers = StepBuffers(model.device)  # the step's inputs: one staging buffer, one copy per step
        self.block_tables = BlockTables(-(-max_model_len // cache_config.block_size) if max_model_len else 16)
        self.graphs: Optional[CUDAGraphRunner] = None
        if cuda_graph_max_seqs and model.device.type == "cuda":
            graphs = CUDAGraphRunner(model, self.kv_caches, cuda_graph_max_seqs, -(-max_model_len // cache_config.block_size))
            try:
                graphs.capture()
                self.graphs = graphs
            except RuntimeError as exc:  # run eagerly rather than not at all
                warnings.warn(f"CUDA graph capture failed, decode steps run eagerly: {exc}", RuntimeWarning)

    def prepare(self, batch: ScheduledBatch):
        """The step's tensors (see the module docstring), built from the plan's plain data: its token
        ids, first positions and the persistent ``BlockTables`` (the step's deltas applied first, by
        ``execute``); positions and the slot mapping are computed by tensor ops, not per token in Python. Also
        returns the sequences that sample a token this step, in ``logits_indices`` order, the beam
        sequences, and the prompt positions whose logits are wanted for prompt logprobs (after
        those in ``logits_indices``)."""
        plan = batch.plan
        bs = self.cache_config.block_size
        starts, counts = plan.num_computed_tokens, plan.num_new_tokens
        n = len(counts)
        input_ids = list(chain.from_iterable(plan.token_ids))
        num_tokens = len(input_ids)
        if num_tokens == n:  # pure decode: one token per sequence
            ends = [c + 1 for c in starts]
            query_start_loc = list(range(n + 1))
        else:
            ends = [c + k for c, k in zip(starts, counts)]
            query_start_loc = list(accumulate(counts, initial=0))  # n + 1 entries
        max_seq_len = max(ends)

        tables = self.block_tables.gather(plan.seq_ids, -(-max_seq_len // bs))  # [n, width]
        starts_t = int_tensor(starts, torch.int64)  # [n]
        if num_tokens == n:
            seq_index, positions = None, starts_t  # [T]
        elif num_tokens <= _FEW_TOKENS:  # decode and verify rows: lists beat five small tensor ops
            seq_index = int_tensor([i for i, k in enumerate(counts) for _ in range(k)], torch.int64)  # [T]
            positions = int_tensor([c + j for c, k in zip(starts, counts) for j in range(k)], torch.int64)  # [T]
        else:
            seq_index = torch.repeat_interleave(torch.arange(n), int_tensor(counts, torch.int64), output_size=num_tokens)  # [T]
            offsets = int_tensor(query_start_loc[:-1], torch.int64)  # [n]
            positions = torch.arange(num_tokens) + (starts_t - offsets)[seq_index]  # [T]
        rows = torch.arange(n) if seq_index is None else seq_index
        flat_block = rows * tables.shape[1] + torch.div(positions, bs, rounding_mode="floor")  # [T] into tables.view(-1)
        slots = tables.view(-1)[flat_block].to(torch.int64) * bs + positions % bs  # [T] int64

        if self.pooler is not None:  # a pooling model: the rows to pool instead of the rows to sample
            # (worker/pooler.py); they take the place of logits_indices, and the pooler's items that of
            # the sampled sequences in what prepare returns
            logits_indices, sampling = self.pooler.rows(batch.seqs, starts, ends, query_start_loc)
            beams, beam_rows, prompt_plan = [], [], PromptLogprobsPlan()
        else:
            logits_indices, sampling, beams, beam_rows, prompt_plan = self._logits_rows(batch, starts, ends, query_start_loc)
        ids_d, positions_d, slots_d, tables_d, seq_lens_d, qsl_d, logits_d = self.buffers.stage([
            int_tensor(input_ids, torch.int64),  # [T]
            positions,  # [T]
            slots,  # [T]
            tables,  # [n, max_blocks]
            int_tensor(ends, torch.int32),  # [n]
            int_tensor(query_start_loc, torch.int32),  # [n + 1]
            int_tensor(logits_indices + beam_rows + prompt_plan.rows, torch.int64),  # [S + B + R]
        ])  # one host-to-device copy (none on the CPU)
        attn = AttentionMetadata(
            slot_mapping=slots_d, block_tables=tables_d, seq_lens=seq_lens_d, query_start_loc=qsl_d, max_seq_len=max_seq_len
        )
        tensors = (ids_d, positions_d, attn, logits_d)
        return tensors, sampling, beams, prompt_plan

    @staticmethod
    def _logits_rows(batch: ScheduledBatch, starts: list[int], ends: list[int], query_start_loc: list[int]):
        """The step's rows whose logits are wanted: (flat row of each sampling sequence's last token,
        those sequences, the beams, the beams' rows, the prompt-logprobs plan). A sequence samples
        when its computed tokens reach its end; a forked parallel sample repeats its parent's row; a
        sequence with drafts (speculative decoding, ``batch.drafts``) gets k + 1 rows (spec_decode/verify.py)."""
        seqs, drafts, partial = batch.seqs, batch.drafts, batch.plan.partial_seq_ids
        prompt_plan = PromptLogprobsPlan()
        if not drafts and not partial and all(end == len(seq.token_ids) and seq.beam_group is None and seq.prompt_logprobs is None
               for seq, end in zip(seqs, ends)):  # the common step: every sequence samples from its last row
            logits_indices, sampling, beams, beam_rows = [r - 1 for r in query_start_loc[1:]], list(seqs), [], []
        else:
            logits_indices, sampling, beams, beam_rows = [], [], [], []
            for seq, start, end, row_end in zip(seqs, starts, ends, query_start_loc[1:]):
                if drafts and drafts.get(seq.seq_id):  # verified: k + 1 rows
                    rows, samplers = verify.draft_rows(seq, drafts[seq.seq_id], row_end)
                    logits_indices.extend(rows)
                    sampling.extend(samplers)
                    continue
                if seq.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
                    prompt_plan.add(seq, start, end, row_end - (end - start))
                if end == len(seq.token_ids) and seq.seq_id not in partial:  # (partial: forced tokens still to come)
                    if seq.beam_group is not None:
                        beam_rows.append(row_end - 1)
                        beams.append(seq)
                    else:
                        logits_indices.append(row_end - 1)
                        sampling.append(seq)
        for child, parent in batch.forked:  # parallel samples share their parent's last row
            logits_indices.append(logits_indices[sampling.index(parent)])
            sampling.append(child)
        return logits_indices, sampling, beams, beam_rows, prompt_plan

    def _propose_drafts(self, batch: ScheduledBatch) -> list[DraftGroup]:
        """Run the draft model for the step's speculating sequences: their drafts replace the
        placeholders in ``batch.drafts`` and in the plan's token ids; returns the rejection
        sampler's groups of the sampled (not greedy) ones (their ``first_row`` set later)."""
        plan, drafts = batch.plan, batch.drafts
        index = [i for i, seq in enumerate(batch.seqs) if drafts.get(seq.seq_id)]
        seqs = [batch.seqs[i] for i in index]
        proposed, qs = self.drafter.propose(seqs, [len(drafts[seq.seq_id]) for seq in seqs], self.block_tables)
        groups = []
        for i, seq, draft, q in zip(index, seqs, proposed, qs):
            drafts[seq.seq_id] = draft
            plan.token_ids[i] = plan.token_ids[i][:1] + draft  # the last committed token, then the drafts
            if not seq.sampling_params.greedy:
                groups.append(DraftGroup(-1, seq, draft, q))
        return groups

    def move_blocks(self, batch: ScheduledBatch) -> None:
        """Swap out, swap in, then copy-on-write copies, in every layer (before the step's forward:
        a block freed by a swap-out may be written by this very step)."""
        for pairs, direction in ((batch.blocks_to_swap_out, "out"), (batch.blocks_to_swap_in, "in")):
            if not pairs:
                continue
            mapping = torch.tensor(pairs, dtype=torch.int64)  # [N, 2] (src, dst)
            for layer, cpu_layer in zip(self.kv_caches, self.cpu_caches):
                for t, ct in zip(layer, cpu_layer):  # keys, values (and a 1-byte cache's scales, moved with them)
                    if direction == "out":
                        ops.swap_blocks(t, ct, mapping)
                    else:
                        ops.swap_blocks(ct, t, mapping)
        if batch.blocks_to_copy:
            mapping = torch.tensor(batch.blocks_to_copy, dtype=torch.int64).to(self.model.device)  # [N, 2]
            for layer in self.kv_caches + (self.drafter.kv_caches if self.drafter is not None else []):
                for i in range(0, len(layer), 2):  # keys and values, then a 1-byte cache's scales
                    ops.copy_blocks(layer[i], layer[i + 1], mapping)

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        """Run one step: the sampled sequences' new tokens, logprobs and prompt logprobs.

        Reads only the plan's plain data and, of each sequence (``batch.seqs``: the driver's own
        Sequences in process, a worker's mirrors built from the step records otherwise), its
        sampling parameters, seed and index, token ids, prompt-logprobs progress and whether it is
        a beam: never the block manager."""
        if self.prefaulter is not None:
            self.prefaulter.before_step(batch.plan.block_table_updates, (batch.blocks_to_copy, batch.blocks_to_swap_in))
        self.move_blocks(batch)
        plan = batch.plan
        self.block_tables.apply(plan.freed_seq_ids, plan.block_table_updates)
        if self.pp is not None:  # (no speculation with pipeline stages: refused by the LLM)
            return self._execute_stage(batch)
        groups = None
        if self.drafter is not None:
            self.drafter.forget(plan.freed_seq_ids)
            if batch.drafts:  # the drafts are placeholders until the draft model proposes them
                groups = self._propose_drafts(batch)
        if self.pooler is not None:
            self.pooler.forget(plan.freed_seq_ids)
            (input_ids, positions, attn, rows), items, _, _ = self.prepare(batch)
            types = self.pooler.token_types(batch.seqs, plan.num_computed_tokens, [c + k for c, k in zip(plan.num_computed_tokens, plan.num_new_tokens)])
            if types is None:
                hidden = self.model.pooled_hidden(input_ids, positions, attn, self.kv_caches, rows)  # [R, hidden]
            else:  # an encoder's cross-encoder pairs: token type 1 from their second segment on
                types_d = torch.tensor(types, dtype=torch.int64).to(input_ids.device)  # [T]
                hidden = self.model.pooled_hidden(input_ids, positions, attn, self.kv_caches, rows, types_d)
            return StepOutput([], [], pooled=self.pooler.outputs(items, hidden, self.model.compute_head))
        (input_ids, positions, attn, logits_indices), sampling, beams, prompt_plan = self.prepare(batch)
        if self.lora is not None:  # each sequence's rows with its adapter (no CUDA graphs with LoRA: engine/build.py)
            self.lora.prepare(batch.seqs, list(accumulate(plan.num_new_tokens, initial=0)))
        if self.graphs is not None and self.graphs.can_run(input_ids.shape[0], len(batch.seqs), attn.block_tables.shape[1]):
            logits = self.graphs.run(input_ids, positions, attn)[logits_indices]  # pure decode step
        else:
            # [S + B + R, vocab] model dtype; with prompt-logprob rows, the hidden rows [S + B + R, hidden]
            # (their logits are made in chunks in _outputs: never [R, vocab] at once)
            logits = self.model.forward(input_ids, positions, attn, self.kv_caches, logits_indices, hidden_only=bool(prompt_plan.rows))
        return self._outputs(batch, logits, sampling, beams, prompt_plan, groups)

    def _execute_stage(self, batch: ScheduledBatch) -> StepOutput:
        """This pipeline stage's part of the step, micro-batch after micro-batch (the module
        docstring); the merged output on the last stage, an empty one on the others."""
        pp, parts = self.pp, []
        for mb in microbatch.split(batch, pp.size):
            (input_ids, positions, attn, logits_indices), sampling, beams, prompt_plan = self.prepare(mb)
            intermediate = None if pp.is_first else pp.prev.recv()  # ([T, hidden], ...) from the previous stage
            out = self.model.forward(input_ids, positions, attn, self.kv_caches, logits_indices, intermediate, hidden_only=bool(prompt_plan.rows))
            if not pp.is_last:
                pp.next.send(out)  # on to the next stage; this one goes on with the next micro-batch
                continue
            parts.append(self._outputs(mb, out, sampling, beams, prompt_plan))
        return microbatch.merge(batch, parts) if pp.is_last else StepOutput([], [])

    def _outputs(self, batch: ScheduledBatch, logits: torch.Tensor, sampling, beams, prompt_plan, groups=None) -> StepOutput:
        """Sample ``logits`` [S + B + R, vocab] (model dtype): the sampled tokens and logprobs,
        the beams' log-softmax rows, the prompt logprobs. With prompt-logprob rows (R > 0),
        ``logits`` are the final hidden rows [S + B + R, hidden] instead: the lm_head runs over
        the S + B rows, then over the R rows in chunks (``chunked_logprob_tensors``). ``groups``:
        the draft model's proposals of this step (``_propose_drafts``), verified by rejection sampling."""
        # the logits stay on the device: the sampler sends back only ids and requested logprobs
        num_sampling, num_beams = len(sampling), len(beams)
        prompt_hidden = None
        if prompt_plan.rows:
            prompt_hidden = logits[num_sampling + num_beams :]  # [R, hidden]
            head = logits[: num_sampling + num_beams]
            logits = self.model.compute_logits(head) if num_sampling + num_beams else None  # [S + B, vocab]
        out = StepOutput(sampling, [])
        if sampling:
            resample = None
            if groups:  # sampled rows verified against a draft model: rejection sampling (sample/rejection_sampler.py)
                where = {id(seq): i for i, seq in enumerate(sampling)}
                for g in groups:
                    g.first_row = where[id(g.seq)]
                resample = partial(resample_groups, groups, self.sampler.draw_key)
            sampled = self.sampler(logits[:num_sampling], sampling, batch.grammar_bitmask, resample)
            out.token_ids, out.logprobs = sampled.token_ids, sampled.logprobs
            if batch.drafts:
                verify.collapse(out, batch.drafts)
        if beams:
            beam_logprobs = logits[num_sampling : num_sampling + num_beams].float().log_softmax(dim=-1).cpu()  # [B, vocab]
            out.beam_logprobs = list(zip(beams, beam_logprobs))
        if prompt_plan.rows:
            targets = torch.tensor(prompt_plan.target_ids, dtype=torch.int64).to(prompt_hidden.device)  # [R]
            packed = chunked_logprob_tensors(prompt_hidden, self.model.compute_logits, targets, max(prompt_plan.num_logprobs))
            dicts = unpack_logprob_dicts(packed.cpu(), prompt_plan.num_logprobs)  # the one copy back
            offset = 0
            for seq, first, count in zip(prompt_plan.seqs, prompt_plan.first_positions, prompt_plan.num_rows):
                out.prompt_logprobs.append((seq, first, dicts[offset : offset + count]))
                offset += count
        return out
