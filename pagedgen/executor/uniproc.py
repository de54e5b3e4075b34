"""Executors that run the model in the driver's process.

``InProcessExecutor`` (the default): the model runner reads the driver's own Sequences; no record
is built and nothing is copied. ``PicklingExecutor`` (``distributed_executor_backend="pickle"``, for
tests and debugging): a ``Worker`` in this process, driven exactly as a worker process is, from step
records; every record and every reply goes through ``pickle`` on the way, so a test run through it
shows that a worker needs nothing but the record, and the driver nothing but the reply.
"""
from __future__ import annotations

import itertools
import pickle
from typing import Callable, Optional

from pagedgen.core.scheduler_output import ScheduledBatch
from pagedgen.core.sequence import Sequence
from pagedgen.executor.messages import NewSequence, StepRecord
from pagedgen.worker.model_runner import ModelRunner, StepOutput
from pagedgen.worker.worker import Worker, WorkerSpec, output_of


class RecordBuilder:
    """Builds the step records of one worker group; remembers which sequences the workers hold
    (scheduled ones stay until their table is freed; forked children are sent for their step)."""

    def __init__(self) -> None:
        self._held: set[int] = set()

    def build(self, step_id: int, batch: ScheduledBatch) -> StepRecord:
        plan, held = batch.plan, self._held
        held.difference_update(plan.freed_seq_ids)  # the workers forget those first
        new = tuple(NewSequence.of(seq) for seq in batch.seqs if seq.seq_id not in held)
        held.update(n.seq_id for n in new)
        forked = tuple(NewSequence.of(child) for child, _ in batch.forked)
        return StepRecord(step_id, plan, new, forked, batch.grammar_bitmask)

    def reset(self) -> None:
        """The workers were replaced: they hold nothing."""
        self._held.clear()


class InProcessExecutor:
    """Runs ``model_runner`` on the driver's ScheduledBatch directly (today's path, no copies)."""

    def __init__(self, model_runner: ModelRunner) -> None:
        self.model_runner = model_runner

    def execute(self, batch: ScheduledBatch, seqs: dict[int, Sequence]) -> StepOutput:
        return self.model_runner.execute(batch)

    def check_usable(self) -> None:
        """Always usable (nothing to end)."""

    def shutdown(self) -> None:
        pass


class PicklingExecutor:
    """A ``Worker`` in this process behind a pickled boundary (see the module docstring)."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.worker = Worker(spec)
        self.model_runner: Optional[ModelRunner] = None  # the model lives behind the boundary
        self._records = RecordBuilder()
        self._ids = itertools.count(1)

    def execute(self, batch: ScheduledBatch, seqs: dict[int, Sequence]) -> StepOutput:
        record = pickle.loads(pickle.dumps(self._records.build(next(self._ids), batch)))
        reply = pickle.loads(pickle.dumps(self.worker.execute(record)))
        return output_of(reply, seqs)

    def collective_rpc(self, fn: Callable, args: tuple = ()) -> list:
        """``[fn(worker, *args)]``."""
        return [fn(self.worker, *args)]

    def check_usable(self) -> None:
        """Always usable (nothing to end)."""

    def shutdown(self) -> None:
        pass
