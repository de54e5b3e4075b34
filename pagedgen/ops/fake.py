"""Fake implementations of pagedgen's ops, for FakeTensor tracing (torch.compile, torch.export) and
``torch.library.opcheck``. Every op writes into its ``Tensor(a!)`` arguments and returns nothing
(csrc/ops.cpp), so a fake only has to accept its arguments.

``register_fakes()`` is called by pagedgen/ops/__init__.py once pagedgen._C has defined the ops.
Registering twice is harmless: recent torch replaces the earlier fake, older torch refuses with
"already has a fake impl", which is ignored here (so another module may register the same fakes).
"""
import torch


def _reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    return None


def _paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens, scale) -> None:
    return None


def _copy_blocks(key_cache, value_cache, block_mapping) -> None:
    return None


def _swap_blocks(src, dst, block_mapping) -> None:
    return None


_FAKES = {
    "reshape_and_cache": _reshape_and_cache,
    "paged_attention": _paged_attention,
    "copy_blocks": _copy_blocks,
    "swap_blocks": _swap_blocks,
}


def register_fakes() -> None:
    """Register the fake of each op defined by pagedgen._C (needs the library loaded)."""
    for name, fn in _FAKES.items():
        try:
            torch.library.register_fake(f"pagedgen::{name}")(fn)
        except RuntimeError as exc:
            if "already has" not in str(exc):
                raise
