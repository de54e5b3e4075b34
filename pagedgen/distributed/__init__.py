"""Tensor- and pipeline-parallel groups and their communication.

A sharded layer gets a ``TPGroup`` in its constructor (never a global): its rank, its size and the
communicator whose ``all_reduce`` / ``all_gather`` it calls (communicator.py, shm.py). A model
family and the model runner get a ``PPGroup``: the stage's layers and the channels that carry the
activations to the next stage (p2p.py). Rank layout: ``rank = pp_rank * tensor_parallel_size +
tp_rank``.
"""
from pagedgen.distributed.group import PPGroup, TPGroup, pp_size, shard_size, stage_layers, tp_rank, tp_size

__all__ = ["PPGroup", "TPGroup", "pp_size", "shard_size", "stage_layers", "tp_rank", "tp_size"]
