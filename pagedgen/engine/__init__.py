"""The engine: request state (sequence), KV block accounting (block_manager), batching (scheduler),
tensors and the model step (model_runner), sampling (sampler), and the step loop (llm_engine)."""
