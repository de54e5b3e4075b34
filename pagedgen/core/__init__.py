"""The scheduler's side (the paper's centralized scheduler and KV cache manager, Kwon et al., SOSP
2023, Section 4.1), tensor-free: it imports no torch and nothing of ``worker``/``sample``.

- ``sequence``: a request's token state (``Sequence``, ``SequenceStatus``);
- ``scheduler``: FCFS iteration-level batching, chunked prefill, preemption (recompute / swap);
- ``scheduler_output``: the step the scheduler plans (``SchedulerOutput``, ``ScheduledBatch``);
- ``block_manager`` with ``blocks``, ``prefix_cache`` and ``block_pool_check``: the KV block pool,
  block tables, reference counts, copy-on-write, prefix caching, and the pool's repair after a failed
  step;
- ``kv_sizing``: how many KV blocks the cache gets.
"""
