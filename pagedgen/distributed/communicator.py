"""Collectives between the tensor-parallel ranks of one machine.

``GlooCommunicator``: torch.distributed's gloo group (a ring all-reduce: every rank ends with the
same bits); ``ShmCommunicator`` (shm.py): the shared-memory fast path between the processes of one
CPU machine, summing in a fixed rank order; ``make_communicator`` picks one (per pipeline stage:
the stage's ranks form a torch.distributed subgroup and have their own shared file).
``make_channel`` picks the channel of a pipeline stage's activations (p2p.py).
``init_process_group`` joins the group through a file store in a temporary folder the driver
made (no fixed port); CUDA workers whose world size equals the device count use nccl (untested
here: one GPU only).
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
    """all_reduce / all_gather through a torch.distributed group (``group``: a pipeline stage's
    tensor-parallel ranks; None: the default group, every rank)."""

    name = "gloo"

    def __init__(self, group=None) -> None:
        self.group = group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)  # in place, sum
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., size * n], rank order along the last dim."""
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


ALLREDUCE_ENV = "PAGEDGEN_TP_ALLREDUCE"  # "shm" or "gloo"


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686")


def make_communicator(backend: str, rank: int, world_size: int, store_path: str, device: torch.device, group=None, stage: int = 0):
    """The tensor-parallel communicator of a rank (``rank``, ``world_size``: within its group, the
    ranks of pipeline stage ``stage``; ``group``: their torch.distributed group, None for the
    default one): on x86 CPUs the shared-memory one (shm.py, one file per stage) unless
    ``PAGEDGEN_TP_ALLREDUCE=gloo``; else torch.distributed's group (gloo, or nccl on GPUs)."""
    choice = os.environ.get(ALLREDUCE_ENV, "shm")
    if choice not in ("shm", "gloo"):
        raise ValueError(f"{ALLREDUCE_ENV} must be 'shm' or 'gloo', got {choice!r}")
    if choice == "shm" and device.type == "cpu" and _x86():
        from pagedgen.distributed.shm import ShmCommunicator

        name = "allreduce" if stage == 0 else f"allreduce-stage{stage}"
        return ShmCommunicator(os.path.join(os.path.dirname(store_path), name), rank, world_size, GlooCommunicator(group))
    return GlooCommunicator(group)


TRANSFER_ENV = "PAGEDGEN_PP_TRANSFER"  # "shm" or "gloo"


def make_channel(store_path: str, src: int, dst: int, device: torch.device, backend: str, peer: int):
    """The channel that carries activations from global rank ``src`` to ``dst`` (p2p.py; ``peer``:
    the other side's rank, ``dst`` on the sender, ``src`` on the receiver): through shared memory
    on x86 CPUs unless ``PAGEDGEN_PP_TRANSFER=gloo``; else torch.distributed send / recv."""
    from pagedgen.distributed.p2p import GlooChannel, ShmChannel

    choice = os.environ.get(TRANSFER_ENV, "shm")
    if choice not in ("shm", "gloo"):
        raise ValueError(f"{TRANSFER_ENV} must be 'shm' or 'gloo', got {choice!r}")
    if choice == "shm" and device.type == "cpu" and _x86():
        return ShmChannel(os.path.join(os.path.dirname(store_path), f"p2p-{src}-{dst}"), peer, device)
    return GlooChannel(peer, device, backend)
