"""Collectives between the tensor-parallel ranks of one machine.

``GlooCommunicator``: torch.distributed's gloo group (a ring all-reduce: every rank ends with the
same bits); ``ShmCommunicator`` (shm.py): the shared-memory fast path between the processes of one
CPU machine, summing in a fixed rank order; ``make_communicator`` picks one. ``init_process_group`` joins the group through a file store in a temporary folder the
driver made (no fixed port); CUDA workers whose world size equals the device count use nccl
(untested here: one GPU only).
"""
from __future__ import annotations

import os
import platform
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def init_process_group(store_path: str, rank: int, world_size: int, device: torch.device) -> str:
    """Join the group of ``world_size`` ranks; returns the backend ("gloo" or "nccl")."""
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one machine: the loopback interface
    use_nccl = device.type == "cuda" and world_size == torch.cuda.device_count()
    backend = "nccl" if use_nccl else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank, world_size=world_size, timeout=timedelta(seconds=600))
    return backend


class GlooCommunicator:
    """all_reduce / all_gather through torch.distributed's default group."""

    name = "gloo"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)  # in place, sum
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., size * n], rank order along the last dim."""
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


ALLREDUCE_ENV = "PAGEDGEN_TP_ALLREDUCE"  # "shm" or "gloo"


def make_communicator(backend: str, rank: int, world_size: int, store_path: str, device: torch.device):
    """The communicator of a rank: on x86 CPUs the shared-memory one (shm.py) unless
    ``PAGEDGEN_TP_ALLREDUCE=gloo``; else torch.distributed's group (gloo, or nccl on GPUs)."""
    choice = os.environ.get(ALLREDUCE_ENV, "shm")
    if choice not in ("shm", "gloo"):
        raise ValueError(f"{ALLREDUCE_ENV} must be 'shm' or 'gloo', got {choice!r}")
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i686")
    if choice == "shm" and device.type == "cpu" and x86:
        from pagedgen.distributed.shm import ShmCommunicator

        return ShmCommunicator(os.path.join(os.path.dirname(store_path), "allreduce"), rank, world_size, GlooCommunicator())
    return GlooCommunicator()
