"""The worker: model, KV cache, sampler and the mirrors of the driver's state it needs.

A worker sees only ``StepRecord``s and answers each with a ``StepReply``:

    driver                                         worker
    scheduler, block manager, Sequences,   ---->   model, KV cache (and swap space), sampler,
    detokenizers, beam groups              record  block-table mirror (ModelRunner.block_tables),
                                           <----   sequence mirrors {seq_id: Sequence}
                                           reply

The sequence mirrors hold what the model runner and the sampler read (sampling settings, seed and
index, token ids, prompt-logprobs progress, whether it is a beam). Per step, in this order: forget
the freed sequences (their blocks were freed: finished, aborted, preempted), add the new ones,
write the step's token ids at their positions (a mirror starts with all of the driver's tokens,
and a decode step appends the token sampled in the step before, so its tokens are the driver's), run the step, advance prompt-logprobs progress, forget this step's forked
children. A mirror never needs a token back from the driver that is not in a record.

With pipeline stages every rank gets the same record; a stage's runner runs its layers on each
micro-batch and hands the activations on (worker/model_runner.py); the last stage samples, the
others reply with an empty ``StepReply`` (every rank answers, so that an error anywhere is seen).
A non-last stage's mirrors do not advance their prompt-logprobs progress (it has no logits):
only the last stage reads it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from pagedgen.config import CacheConfig
from pagedgen.core.scheduler_output import ScheduledBatch
from pagedgen.core.sequence import Sequence
from pagedgen.distributed.communicator import init_process_group, make_channel, make_communicator
from pagedgen.distributed.group import PPGroup, TPGroup, stage_layers
from pagedgen.executor.messages import StepRecord, StepReply
from pagedgen.layers.matmul import MatmulConfig, prepare_matmuls
from pagedgen.lora.manager import LoRAManager
from pagedgen.model import loader
from pagedgen.sample.sampler import Sampler
from pagedgen.worker.model_runner import ModelRunner, StepOutput


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to build itself, checked by ``LLM`` before any worker starts.

    ``dtype``: the resolved model dtype; ``num_threads``: torch intra-op threads per worker (0:
    torch's own default); ``cuda_graph_max_seqs``: as ``ModelRunner``'s (0 when
    ``tensor_parallel_size`` > 1: the collectives are not captured); ``tensor_parallel_size``: the
    ranks that each hold a shard of the weights and of the KV cache (KV heads split across them);
    ``pipeline_parallel_size``: the stages that each hold a run of the decoder layers (and their KV
    cache); ``tensor_parallel_size * pipeline_parallel_size`` ranks in all.
    """

    model: str
    dtype: torch.dtype
    device: torch.device
    matmul_config: MatmulConfig
    cache_config: CacheConfig
    max_model_len: int
    seed: int
    cuda_graph_max_seqs: int = 0
    num_threads: int = 0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    quantization: str = ""  # the resolved method (ModelConfig.quantization): each rank quantizes or reads its shards
    lora: Optional[tuple] = None  # LoRA on: (LoRAConfig, ModelShapes); each rank's slots hold its shard of A or B

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


class Worker:
    """Builds the model and its runner from ``spec`` and runs step records.

    Args:
        spec: the model, device, cache and seed.
        rank: this worker's global rank, ``pp_rank * tensor_parallel_size + tp_rank``.
        store_path: with more than one rank, the file the ranks meet at (torch.distributed's
            file store, in the driver's temporary folder, beside the shared-memory files).
    """

    def __init__(self, spec: WorkerSpec, rank: int = 0, store_path: Optional[str] = None) -> None:
        if spec.num_threads:
            torch.set_num_threads(spec.num_threads)
        self.spec = spec
        self.rank = rank
        tp_size, pp_size = spec.tensor_parallel_size, spec.pipeline_parallel_size
        self.pp_rank, self.tp_rank = divmod(rank, tp_size)
        self.tp: Optional[TPGroup] = None
        self.pp: Optional[PPGroup] = None
        hf_config = loader.load_hf_config(spec.model)
        model_config = loader.model_config_from_hf(hf_config, spec.dtype, spec.quantization or "none")
        if spec.world_size > 1:
            self.backend = init_process_group(store_path, rank, spec.world_size, spec.device)
        if tp_size > 1:
            group = None  # the default group: every rank is this stage's
            if pp_size > 1:  # every rank creates every stage's group, in the same order
                group = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size))) for s in range(pp_size)][self.pp_rank]
            comm = make_communicator(self.backend, self.tp_rank, tp_size, store_path, spec.device, group, self.pp_rank)
            self.tp = TPGroup(self.tp_rank, tp_size, comm)
        if pp_size > 1:
            start, end = stage_layers(model_config.num_layers, pp_size, self.pp_rank)
            prev_rank, next_rank = rank - tp_size, rank + tp_size  # the same TP rank of the stages before and after
            prev = make_channel(store_path, prev_rank, rank, spec.device, self.backend, prev_rank) if self.pp_rank > 0 else None
            nxt = make_channel(store_path, rank, next_rank, spec.device, self.backend, next_rank) if self.pp_rank < pp_size - 1 else None
            self.pp = PPGroup(self.pp_rank, pp_size, start, end, prev, nxt)
        model = loader.load_model(spec.model, hf_config, model_config, spec.device, self.tp, self.pp)
        prepare_matmuls(model, spec.matmul_config)
        lora = None if spec.lora is None else LoRAManager(model, *spec.lora)
        self.runner = ModelRunner(model, spec.cache_config, Sampler(spec.seed), spec.cuda_graph_max_seqs, spec.max_model_len, self.pp, lora=lora)
        self.seqs: dict[int, Sequence] = {}  # the sequence mirrors, by seq id

    @property
    def transfer(self) -> str:
        """The channel of this rank's activations ("shm", "gloo"; "" without pipeline stages)."""
        if self.pp is None:
            return ""
        return (self.pp.next or self.pp.prev).name

    def execute(self, record: StepRecord) -> StepReply:
        plan, seqs, max_len = record.plan, self.seqs, self.spec.max_model_len
        for seq_id in plan.freed_seq_ids:
            seqs.pop(seq_id, None)
        for new in record.new_seqs:
            seqs[new.seq_id] = new.mirror(max_len)
        scheduled = [seqs[seq_id] for seq_id in plan.seq_ids]
        for seq, start, tokens in zip(scheduled, plan.num_computed_tokens, plan.token_ids):
            seq.token_ids[start : start + len(tokens)] = tokens  # a decode token lands at the end
        children = {new.seq_id: new.mirror(max_len) for new in record.forked}
        forked = [(children[child], seqs[parent]) for child, parent in plan.forked]
        out = self.runner.execute(ScheduledBatch(plan, scheduled, forked, record.grammar_bitmask))
        for seq, first, entries in out.prompt_logprobs:
            seq.add_prompt_logprobs(first, [None] * len(entries))
        return reply_of(record.step_id, out)


def reply_of(step_id: int, out: StepOutput) -> StepReply:
    """The plain-data reply of a model runner's output."""
    beams = out.beam_logprobs
    return StepReply(
        step_id=step_id,
        seq_ids=[seq.seq_id for seq in out.seqs],
        token_ids=out.token_ids,
        logprobs=out.logprobs,
        prompt_logprobs=[(seq.seq_id, first, entries) for seq, first, entries in out.prompt_logprobs],
        beam_seq_ids=[seq.seq_id for seq, _ in beams],
        beam_logprobs=torch.stack([row for _, row in beams]) if beams else None,
    )


def output_of(reply: StepReply, seqs: dict[int, Sequence]) -> StepOutput:
    """The driver's ``StepOutput`` of a reply: ids back to the driver's Sequences (``seqs``: the
    scheduler's unfinished sequences by id)."""
    out = StepOutput([seqs[i] for i in reply.seq_ids], reply.token_ids, reply.logprobs)
    out.prompt_logprobs = [(seqs[i], first, entries) for i, first, entries in reply.prompt_logprobs]
    if reply.beam_seq_ids:
        out.beam_logprobs = [(seqs[i], row) for i, row in zip(reply.beam_seq_ids, reply.beam_logprobs)]
    return out
