"""The worker's side: it holds the model (or its shard), the paged KV cache, the input buffers and
the sampler, and sees only the step the scheduler planned (in process: the driver's objects; in a
worker process: the plain-data ``StepRecord``). ``worker`` (one rank: loading, process groups,
execute), ``model_runner`` (step tensors, forward, sampling), ``block_tables`` (the persistent
block-table tensor), ``microbatch`` (a step cut into pipeline micro-batches), ``step_buffers``,
``cuda_graphs``, ``prefault`` (first-touch of KV pages) and ``kv_profile`` (the GPU profiling pass
that sizes the KV cache). Imports nothing of ``core``'s scheduler or block manager."""
