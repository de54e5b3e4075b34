"""Building blocks of the model families (``pagedgen/model/``), each owning its weights and how
they load from a checkpoint (nano-vllm's and vLLM's ``layers/``):

- ``matmul``: ``linear()``, the single point of every matmul, and how it runs (the CPU paths, weight
  packing, batch-invariant row blocks).
- ``linear``: column/row-parallel, merged (gate/up) and q/k/v linear layers with per-parameter
  weight loaders; their matmul is ``matmul.linear``.
- ``norm``: RMSNorm (Llama and Gemma forms), LayerNorm; both with an optional residual add.
- ``rotary_embedding``: RoPE, full/partial, neox/GPT-J style, transformers' scaling types.
- ``embedding``: token embedding, learned absolute positions, the lm_head.
- ``activation``: activations by config name, gated ``act(gate) * up``.
- ``attention``: the paged KV-cache attention (``AttentionMetadata``, ``Attention``).
- ``loading``: the default weight loader and the shape check every loader makes.
- ``module``: ``Module``, the ``nn.Module`` base of all of them, with cheap calls and attribute reads.
"""
