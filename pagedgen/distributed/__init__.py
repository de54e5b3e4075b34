"""Tensor-parallel groups and their collectives (``TPGroup``, communicator.py).

A sharded layer gets a ``TPGroup`` in its constructor (never a global): its rank, its size and the
communicator whose ``all_reduce`` / ``all_gather`` it calls. Rank layout across pipeline stages,
when they come: ``rank = pp_rank * tensor_parallel_size + tp_rank``.
"""
from pagedgen.distributed.group import TPGroup, shard_size, tp_rank, tp_size

__all__ = ["TPGroup", "shard_size", "tp_rank", "tp_size"]
