"""Transparent huge pages for the CPU KV cache.

A decode step reads every sequence's blocks, which the block table scatters over the cache; with
4 KiB pages each block boundary is also a page (TLB) boundary the hardware prefetcher does not
cross, and on a 2-core AVX2 EPYC that cost the paged kernel +8..+27% over the same kernel on
consecutive blocks (benchmarks/cpu_kernels.py, "paging price"). Backing the cache with 2 MiB pages
(Linux transparent huge pages, ``madvise(MADV_HUGEPAGE)``) removes most of it. The call is advice:
where the kernel has THP off, or the platform is not Linux, nothing changes.
"""
from __future__ import annotations

import ctypes
import sys

import torch

HUGE_PAGE = 2 << 20  # bytes: x86-64 and arm64 transparent huge pages
MADV_HUGEPAGE = 14  # <sys/mman.h>

_libc = None


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask Linux to back the 2 MiB-aligned part of a CPU tensor's memory with huge pages
    (``madvise(MADV_HUGEPAGE)``). Call it before the memory is first written (a ``torch.empty``
    tensor): pages touched afterwards come as huge pages. The tensor's values are not changed.

    Args:
        t: a contiguous CPU tensor, any dtype and shape.

    Returns:
        True if the advice was taken; False for a CUDA tensor, a tensor smaller than 2 MiB, a
        platform other than Linux, or a kernel that refuses it (THP off: ``enabled`` = never).
    """
    global _libc
    if t.device.type != "cpu" or not sys.platform.startswith("linux") or not t.is_contiguous():
        return False
    begin = t.data_ptr()
    end = begin + t.numel() * t.element_size()
    lo = (begin + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
    hi = end & ~(HUGE_PAGE - 1)
    if hi <= lo:
        return False
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            _libc.madvise.restype = ctypes.c_int
        return _libc.madvise(lo, hi - lo, MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False
