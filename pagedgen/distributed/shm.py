"""``ShmCommunicator``: an all-reduce between the tensor-parallel processes of one machine through
shared memory (vLLM's CPU backend has one too: gloo over loopback TCP costs tens of microseconds a
call, a model step makes two per layer).

    file (/dev/shm):  flags [size x 64 bytes]   slots [2 sets][size ranks][CHUNK bytes]

A round (one chunk of one collective): rank r waits until every rank has posted the round
before the previous one (they have read this set's slots), copies its part into its slot of set
``round % 2``, posts ``flags[r] = round`` and waits for every flag to reach ``round``; then each
rank sums the slots **in rank order 0, 1, ..., N - 1**: every rank computes the same sum, so the
ranks get bitwise equal results that do not depend on timing. The ordering of a slot's data
before its flag relies on x86's store order (TSO); other CPUs use gloo (``make_communicator``).
Waiting spins with ``sched_yield``. A tensor larger than a slot goes in chunks; an all-gather too
large for a slot goes through the fallback (gloo).
"""
from __future__ import annotations

import os

import numpy as np
import torch

CHUNK_BYTES = 4 << 20  # one slot
FLAG_STRIDE = 8  # int64 per flag: one 64-byte cache line each


class ShmCommunicator:
    """all_reduce / all_gather through a shared file mapped by every rank (see the module docstring)."""

    name = "shm"

    def __init__(self, path: str, rank: int, size: int, fallback) -> None:
        self.rank, self.size, self.fallback = rank, size, fallback
        flag_bytes = size * FLAG_STRIDE * 8
        total = flag_bytes + 2 * size * CHUNK_BYTES
        buf = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)  # created zeroed by the first rank
        self._buf = buf
        self._flags = buf[:flag_bytes].view(torch.int64).numpy()[::FLAG_STRIDE]  # [size], shared
        self._slots = buf[flag_bytes:].view(2, size, CHUNK_BYTES)  # [set, rank, bytes]
        self._round = 0

    def _wait(self, value: int) -> None:
        flags = self._flags
        while flags.min() < value:
            os.sched_yield()

    def _post(self, part: torch.Tensor) -> torch.Tensor:
        """One round: ``part`` (flat, contiguous) into this rank's slot; returns the set's slots as
        [size, numel] of part's dtype, once every rank has posted."""
        self._round += 1
        r = self._round
        nbytes = part.numel() * part.element_size()
        self._wait(r - 1)  # every rank has read this set's slots of round r - 2
        slots = self._slots[r % 2, :, :nbytes].view(part.dtype)  # [size, numel]
        slots[self.rank].copy_(part)
        self._flags[self.rank] = r
        self._wait(r)
        return slots

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks in place, in rank order (bitwise the same on every rank)."""
        flat = x.view(-1)
        step = CHUNK_BYTES // x.element_size()
        for start in range(0, flat.numel(), step):
            part = flat[start : start + step]
            slots = self._post(part)
            torch.add(slots[0], slots[1], out=part)
            for k in range(2, self.size):
                part.add_(slots[k])
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., size * n], rank order along the last dim."""
        if x.numel() * x.element_size() > CHUNK_BYTES:
            return self.fallback.all_gather(x)
        x = x.contiguous()
        slots = self._post(x.view(-1))  # [size, numel]
        return torch.cat([slots[k].view(x.shape) for k in range(self.size)], dim=-1)
