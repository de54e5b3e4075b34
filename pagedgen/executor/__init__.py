"""Executors: how the engine's driver runs each step's model work.

The driver (``LLMEngine``: scheduler, block manager, Sequences, detokenizers, beam groups) calls
``executor.execute(batch, seqs) -> StepOutput`` once per step. Backends
(``LLM(distributed_executor_backend=...)``):

- None (the default): ``InProcessExecutor``, the model runner in this process reading the
  driver's Sequences directly, with no copies;
- ``"mp"``: ``MultiprocExecutor``, a worker process that holds the model, the KV cache and the
  sampler and sees only the plain-data ``StepRecord`` of each step, answering with a
  ``StepReply`` (messages.py);
- ``"pickle"``: ``PicklingExecutor``, the same worker in this process with every record and reply
  pickled and unpickled: the test of the boundary without process start-up.

``tensor_parallel_size`` = N > 1 runs N ``"mp"`` workers, each with its shard of the weights and
the KV cache (pagedgen/distributed, docs/architecture.md); ``pipeline_parallel_size`` = P runs P
stages of N workers each, a run of the decoder layers per stage, each step in micro-batches
(worker/microbatch.py).
"""
from __future__ import annotations

BACKENDS = (None, "mp", "pickle")
