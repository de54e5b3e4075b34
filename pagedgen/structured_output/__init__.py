"""Structured outputs (vLLM's ``StructuredOutputsParams``): ``params`` (the user's constraint: JSON
schema, regex, choice, grammar), ``grammar`` (llguidance matchers per request in the driver,
compiled once per constraint) and ``token_bitmask`` (the ``[rows, ceil(vocab / 32)]`` int32 mask
applied to the logits before sampling). See docs/structured_outputs.md."""
