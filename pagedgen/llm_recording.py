"""``LLM``'s calls that watch the engine, a mixin: ``get_stats``, ``start_recording``, ``stop_recording``."""
from __future__ import annotations

from pagedgen.engine.stats import EngineStats
from pagedgen.engine.step_log import StepLog


class RecordingCalls:
    """Mixed into ``LLM`` (which sets ``llm_engine``)."""

    def get_stats(self) -> EngineStats:
        """KV cache and scheduling counters since this LLM was made (see ``EngineStats``)."""
        return self.llm_engine.stats()

    def start_recording(self) -> StepLog:
        """Record the figures of every engine step from now on (running / waiting / swapped
        sequences, KV blocks in use and their utilisation, prefill and decode tokens, preemptions)
        into a new ``StepLog``, returned; draw it with ``pagedgen.plot.steps``. Costs a few
        microseconds per step; a second call stops the current log and starts a new one.
        Named after vLLM's ``LLM.start_profile``/``stop_profile``."""
        engine = self.llm_engine
        if engine.step_log is not None:
            engine.step_log.stop()
        engine.step_log = StepLog(engine.scheduler, engine.block_manager, engine.num_generated_tokens)
        return engine.step_log

    def stop_recording(self) -> StepLog:
        """Stop recording; returns the ``StepLog`` that ``start_recording`` returned (it keeps
        what it recorded).

        Raises:
            RuntimeError: not recording (``start_recording`` was not called, or already stopped).
        """
        log = self.llm_engine.step_log
        if log is None:
            raise RuntimeError("not recording: call LLM.start_recording() first")
        log.stop()
        self.llm_engine.step_log = None
        return log
