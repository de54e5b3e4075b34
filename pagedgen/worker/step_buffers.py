"""Persistent step buffers: a step's input tensors reach the model's device in one copy.

A step's inputs (input ids, positions, slot mapping, block tables, seq lens, query_start_loc,
logits indices) are built on the host as small int32/int64 tensors. On a GPU they are written, in
place, into one persistent host staging buffer (pinned, so the copy is asynchronous) at 8-byte
aligned offsets, and that buffer's used prefix is copied into one persistent device buffer with a
single ``copy_(non_blocking=True)``; the tensors the model sees are views of the device buffer:

    host  [ input_ids | positions | slots | block_tables | seq_lens | query_start_loc | logits_idx ]  pinned uint8
            |  one host-to-device copy per step
    device[ input_ids | positions | slots | block_tables | seq_lens | query_start_loc | logits_idx ]  uint8, views by dtype

Before the staging buffer is written again, the host waits on the event recorded after the last
copy (the copy may still be reading it). The buffers grow by doubling and are never shrunk, so a
steady workload reuses the same memory every step. CUDA graphs keep their own static inputs
(worker/cuda_graphs.py) and copy from these views on the device, so their addresses never move.

On the CPU the host tensors are the model's inputs: no staging, no copy at all.
"""
from __future__ import annotations

from typing import Optional

import torch


class StepBuffers:
    """Stages each step's input tensors for ``device`` (see the module docstring).

    Args:
        device: the model's device.
        stage_on_cpu: stage through the buffers on the CPU too (tests run the GPU path's logic so).
    """

    def __init__(self, device: torch.device, stage_on_cpu: bool = False) -> None:
        self.device = device
        self.on_cpu = device.type == "cpu" and not stage_on_cpu
        self.host = torch.empty(0, dtype=torch.uint8)
        self.dev = torch.empty(0, dtype=torch.uint8, device=device)
        self._copied: Optional[torch.cuda.Event] = None  # recorded after the last host-to-device copy

    def stage(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors``: contiguous host int32/int64 tensors. Returns the same tensors on the device
        (views of the device buffer, filled by one copy), or the tensors themselves on the CPU."""
        if self.on_cpu:
            return tensors
        offsets, total = [], 0
        for t in tensors:
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // 8) * 8  # 8-byte aligned: any int dtype views in place
        if self._copied is not None:
            self._copied.synchronize()  # the previous copy has finished reading the staging buffer
        if total > self.host.numel():
            size = max(total, 2 * self.host.numel(), 4096)
            self.host = torch.empty(size, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
            self.dev = torch.empty(size, dtype=torch.uint8, device=self.device)
        for t, off in zip(tensors, offsets):
            nbytes = t.numel() * t.element_size()
            self.host[off : off + nbytes].view(t.dtype).copy_(t.reshape(-1))
        self.dev[:total].copy_(self.host[:total], non_blocking=True)  # the step's one host-to-device copy
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        out = []
        for t, off in zip(tensors, offsets):
            nbytes = t.numel() * t.element_size()
            out.append(self.dev[off : off + nbytes].view(t.dtype).view(t.shape))
        return out
