"""Channels that carry a pipeline stage's activations to the next stage (one direction, one peer).

``ShmChannel``: through a file in /dev/shm that both processes map (the fast path between the
processes of one CPU machine); ``GlooChannel``: torch.distributed ``send`` / ``recv`` (the
fallback, ``PAGEDGEN_PP_TRANSFER=gloo``, and the path of non-x86 CPUs and GPUs). A message is a
tuple of up to ``MAX_TENSORS`` tensors of up to 4 dims (a stage's hidden states ``[T, hidden]``,
and the residual ``[T, hidden]`` where the family carries one apart); the receiver gets new
tensors of the same dtypes and shapes, bitwise the sent ones.

    file (/dev/shm):  posted (int64, its own cache line)   acked (int64, its own cache line)
                      meta [2 slots][32 int64]             data [2 slots][SLOT_BYTES]

Message n (1, 2, ...) uses slot ``n % 2``: the sender waits until the receiver has acked message
n - 2 (it has copied that slot out), writes the meta (dtype codes and shapes) and the data, then
posts ``posted = n``; the receiver waits for ``posted >= n``, copies the tensors out and acks
``acked = n``. So the sender runs ahead by up to two messages (a stage can compute its next
micro-batch while the next stage reads the last one). A message larger than a slot is announced in
the meta and its tensors go through gloo. The data-before-flag order relies on x86's store order
(TSO), as shm.py's all-reduce does; other CPUs use ``GlooChannel``.
"""
from __future__ import annotations

import os
import time
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

SLOT_BYTES = 16 << 20  # one message's data; larger ones go through gloo
MAX_TENSORS = 4
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32)
_META = 2 + 6 * MAX_TENSORS  # [via gloo, count, (dtype code, ndim, d0, d1, d2, d3) per tensor]
_ALIGN = 64
_HEADER_BYTES = 128 + 2 * 32 * 8  # posted, acked, 2 meta slots of 32 int64


def _encode(tensors: Sequence[torch.Tensor]) -> list[int]:
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"a pipeline message holds at most {MAX_TENSORS} tensors, got {len(tensors)}")
    meta = [0, len(tensors)]
    for t in tensors:
        if t.dim() > 4:
            raise ValueError(f"a pipeline message's tensors have at most 4 dims, got shape {tuple(t.shape)}")
        meta += [_DTYPES.index(t.dtype), t.dim()] + list(t.shape) + [0] * (4 - t.dim())
    return meta + [0] * (_META - len(meta))


def _decode(meta) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    out = []
    for i in range(int(meta[1])):
        code, ndim, *dims = (int(v) for v in meta[2 + 6 * i : 8 + 6 * i])
        out.append((_DTYPES[code], tuple(dims[:ndim])))
    return out


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()


def _wait(flag: np.ndarray, value: int) -> None:
    """Spin (yielding the CPU) until ``flag[0] >= value``; after a millisecond, sleep between looks."""
    spins = 0
    while flag[0] < value:
        spins += 1
        if spins < 2000:
            os.sched_yield()
        else:
            time.sleep(50e-6)


class ShmChannel:
    """One direction between two ranks through a shared file (see the module docstring).

    Args:
        path: the file (created zeroed by whichever side maps it first).
        peer: the other side's global rank (for messages that go through gloo).
        device: where received tensors go (the data travels through host memory).
    """

    name = "shm"

    def __init__(self, path: str, peer: int, device: torch.device = torch.device("cpu")) -> None:
        self.peer, self.device = peer, device
        buf = torch.from_file(path, shared=True, size=_HEADER_BYTES + 2 * SLOT_BYTES, dtype=torch.uint8)
        self._buf = buf
        words = buf[:_HEADER_BYTES].view(torch.int64).numpy()
        self._posted, self._acked = words[0:1], words[8:9]
        self._meta = words[16:].reshape(2, 32)
        self._data = buf[_HEADER_BYTES:].view(2, SLOT_BYTES)  # [slot, bytes]
        self._count = 0

    def send(self, tensors: Sequence[torch.Tensor]) -> None:
        self._count += 1
        n, slot = self._count, self._count % 2
        _wait(self._acked, n - 2)  # the receiver has copied out message n - 2, which used this slot
        meta = _encode(tensors)
        sizes = [-(-_nbytes(t.dtype, tuple(t.shape)) // _ALIGN) * _ALIGN for t in tensors]
        via_gloo = sum(sizes) > SLOT_BYTES
        meta[0] = int(via_gloo)
        self._meta[slot, :_META] = meta
        if not via_gloo:
            offset = 0
            for t, size in zip(tensors, sizes):
                dst = self._data[slot, offset : offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                dst.copy_(t)
                offset += size
        self._posted[0] = n
        if via_gloo:
            for t in tensors:
                dist.send(t.contiguous().cpu(), self.peer)

    def recv(self) -> tuple[torch.Tensor, ...]:
        self._count += 1
        n, slot = self._count, self._count % 2
        _wait(self._posted, n)
        meta = self._meta[slot].copy()
        out, offset = [], 0
        for dtype, shape in _decode(meta):
            if meta[0]:
                t = torch.empty(shape, dtype=dtype)
                dist.recv(t, self.peer)
            else:
                nbytes = _nbytes(dtype, shape)
                t = self._data[slot, offset : offset + nbytes].view(dtype).view(shape).clone()
                offset += -(-nbytes // _ALIGN) * _ALIGN
            out.append(t if self.device.type == "cpu" else t.to(self.device))
        self._acked[0] = n
        return tuple(out)


class GlooChannel:
    """One direction between two ranks through torch.distributed ``send`` / ``recv`` (a header
    tensor of dtypes and shapes, then each tensor). With gloo the tensors travel through host
    memory; with nccl (GPUs, one per rank) they stay on the device."""

    name = "gloo"

    def __init__(self, peer: int, device: torch.device = torch.device("cpu"), backend: str = "gloo") -> None:
        self.peer, self.device = peer, device
        self._host = backend != "nccl"

    def send(self, tensors: Sequence[torch.Tensor]) -> None:
        header = torch.tensor(_encode(tensors), dtype=torch.int64)
        dist.send(header if self._host else header.to(self.device), self.peer)
        for t in tensors:
            dist.send(t.contiguous().cpu() if self._host else t.contiguous(), self.peer)

    def recv(self) -> tuple[torch.Tensor, ...]:
        header = torch.empty(_META, dtype=torch.int64, device="cpu" if self._host else self.device)
        dist.recv(header, self.peer)
        out = []
        for dtype, shape in _decode(header.cpu().tolist()):
            t = torch.empty(shape, dtype=dtype, device="cpu" if self._host else self.device)
            dist.recv(t, self.peer)
            out.append(t.to(self.device))
        return tuple(out)
