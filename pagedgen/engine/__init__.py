"""The request lifecycle in the driver: ``build`` (an ``LLMEngine`` built from ``LLM(...)``'s
arguments: configs, tokenizer, KV cache size, executor), ``offline`` (``LLM``'s calls: the one
entry of ``generate`` / ``chat`` / ``beam_search`` / ``generate_stream`` and the loops over
``step``), ``llm_engine`` (``LLMEngine``: add requests, step, abort, the step over ``core``'s
scheduler and an ``executor``), ``processor`` (prompts and ``SamplingParams`` checked and turned
into requests; ``RequestOutput`` assembly), ``detokenizer`` (incremental text and stop strings),
``beam_group`` (a beam search's beams and finished hypotheses) and ``step_log`` (per-step figures
for ``LLM.start_recording``)."""
