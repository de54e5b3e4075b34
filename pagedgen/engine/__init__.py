"""The request lifecycle in the driver: ``llm_engine`` (``LLMEngine``: add requests, step, abort,
the step loop over ``core``'s scheduler and an ``executor``), ``processor`` (prompts and
``SamplingParams`` checked and turned into requests and sequences; ``RequestOutput`` assembly),
``detokenizer`` (incremental text and stop strings), ``beam_group`` (a beam search's beams and
finished hypotheses) and ``step_log`` (per-step figures for ``LLM.start_recording``)."""
