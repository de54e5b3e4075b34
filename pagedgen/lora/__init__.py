"""Multi-LoRA: PEFT adapters applied per request, several in one batch (docs/lora.md).

``request.py``: ``LoRARequest`` (vLLM's name and fields); ``config.py``: ``LoRAConfig`` (``LLM``'s
``max_loras``, ``max_lora_rank``, ``max_cpu_loras``); ``peft.py``: a PEFT adapter folder read and
checked against the model's shapes (the driver checks every request's adapter before any work);
``layers.py``: the per-row delta ``x A^T B^T scale`` of the adapted projections, each row by its
adapter slot (punica's SGMV: one ``ops.add_lora_linear`` per projection and step); ``manager.py``: the
worker's adapter slots (LRU over ``max_loras``) and host cache (``max_cpu_loras``), and each row's slot.
"""
