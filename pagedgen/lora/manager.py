"""The worker's adapters: ``max_loras`` device slots (LRU), a host cache of ``max_cpu_loras`` loaded
adapters (LRU), and each step's row slots (vLLM's ``LoRAModelManager`` / punica's mapping, in one
small object).

    step: seqs s_0..s_{n-1}, rows [q_i, q_{i+1}) each, adapter id a_i (0: the base model)
      -> slot of each distinct a_i != 0 (loaded from the host cache, or from disk, on a miss; the
         least recently used slot not needed by this step is reused)
      -> LoRABatch.slots = [T] int32, each row's slot (-1: none); every adapted layer reads it

The scheduler never plans more distinct adapters in a step than ``max_loras`` (core/scheduler.py),
so a step always finds its slots.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch

from pagedgen.lora.config import LoRAConfig
from pagedgen.lora.layers import LoRABatch, LoRALayer, lora_layers
from pagedgen.lora.peft import TARGETS, ModelShapes, load_adapter


class LoRAManager:
    """Adapter slots over ``model``'s projections (each gets a ``LoRALayer`` as ``.lora``).

    Args:
        model: the loaded model (Llama family; ValueError otherwise, see ``lora_layers``).
        config: the LLM's ``LoRAConfig``.
        shapes: the model's ``ModelShapes`` (what an adapter must fit).
    """

    def __init__(self, model, config: LoRAConfig, shapes: ModelShapes) -> None:
        self.config, self.shapes, self.device = config, shapes, model.device
        self.batch = LoRABatch()
        parts = {"self_attn.qkv_proj": 3, "self_attn.o_proj": 1, "mlp.gate_up_proj": 2, "mlp.down_proj": 1}
        self.layers: dict[tuple[int, str], LoRALayer] = {}
        for i, path, proj in lora_layers(model):
            proj.lora = LoRALayer(proj, parts[path], config.max_loras, config.max_lora_rank, self.batch)
            self.layers[(i, path)] = proj.lora
        self._host: OrderedDict = OrderedDict()  # lora_int_id -> (AdapterInfo, weights), least recent first
        self._slots: OrderedDict = OrderedDict()  # lora_int_id -> slot, least recent first
        self._free = list(range(config.max_loras))
        self.num_disk_loads = 0
        self.num_slot_loads = 0

    def prepare(self, seqs: Sequence, query_start_loc: Sequence[int]) -> None:
        """Set the step's row slots: ``seqs[i]`` (its ``lora_request``) owns rows
        ``[query_start_loc[i], query_start_loc[i + 1])`` of the flat batch. One [T] int32 tensor for
        every adapted layer of the step (one host-to-device copy)."""
        requests = {}
        for i, seq in enumerate(seqs):
            lr = seq.lora_request
            if lr is not None and query_start_loc[i + 1] > query_start_loc[i]:
                requests[lr.lora_int_id] = lr
        self.batch.slots, self.batch.used = None, frozenset()
        if not requests:
            return
        if len(requests) > self.config.max_loras:  # the scheduler's bound; a plain error, not a wrong answer
            raise RuntimeError(f"a step with {len(requests)} distinct adapters, more than max_loras={self.config.max_loras}")
        slot_of = {lora_id: self._slot(lr, requests) for lora_id, lr in requests.items()}
        rows: list[int] = []
        for i, seq in enumerate(seqs):
            lr = seq.lora_request
            rows += [-1 if lr is None else slot_of[lr.lora_int_id]] * (query_start_loc[i + 1] - query_start_loc[i])
        self.batch.slots = torch.tensor(rows, dtype=torch.int32).to(self.device)  # [T]
        self.batch.used = frozenset(slot_of.values())

    def clear(self) -> None:
        """No adapter for the next forward (a forward run outside ``prepare``: profiling, drafts)."""
        self.batch.slots, self.batch.used = None, frozenset()

    def _slot(self, lora, needed) -> int:
        """The slot holding ``lora`` (loading it into the least recently used slot the step does not need)."""
        lora_id = lora.lora_int_id
        slot = self._slots.get(lora_id)
        if slot is not None:
            self._slots.move_to_end(lora_id)
            return slot
        info, weights = self._load(lora)
        if self._free:
            slot = self._free.pop(0)
        else:
            victim = next(i for i in self._slots if i not in needed)
            slot = self._slots.pop(victim)
        self._slots[lora_id] = None  # claimed: a failure below leaves the slot empty, not stale
        try:
            per_layer: dict = {}
            for (layer, module), ab in weights.items():
                path, part, _ = TARGETS[module]
                per_layer.setdefault((layer, path), {})[part] = ab
            for key, lora_layer in self.layers.items():
                lora_layer.set_slot(slot, per_layer.get(key, {}), info.scale)
        except BaseException:
            del self._slots[lora_id]
            for lora_layer in self.layers.values():
                lora_layer.clear_slot(slot)
            self._free.append(slot)
            raise
        self._slots[lora_id] = slot
        self.num_slot_loads += 1
        return slot

    def _load(self, lora):
        """(AdapterInfo, weights) from the host cache, else from disk (evicting the least recent)."""
        entry = self._host.get(lora.lora_int_id)
        if entry is not None:
            self._host.move_to_end(lora.lora_int_id)
            return entry
        entry = load_adapter(lora.lora_path, self.shapes, self.config.max_lora_rank)
        self.num_disk_loads += 1
        while len(self._host) >= self.config.max_cpu_loras:
            self._host.popitem(last=False)
        self._host[lora.lora_int_id] = entry
        return entry
