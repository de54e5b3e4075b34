"""The generation loop over the request-level engine (``llm.llm_engine``: add_request / step /
abort_request), one input row per request.

Rows are admitted in input order while fewer than ``max_in_flight`` run and the writer's reorder
buffer has room; they are read and made into requests up to ``READ_AHEAD`` (at most
``max_in_flight``) at a time, their texts tokenized in one call (``RequestBuilder.build_many``),
then added one by one. Each row is validated
on its own (``add_request`` raises for a bad one and leaves the engine as it was), so a bad row is
caught where it is and the rest go on (``--on-error skip``) or the run stops after the rows before
it finish (``stop``; rows read ahead after it are not added). With ``skip`` a row that fails
mid-generation (its structured-output grammar at a dead end) goes to the errors file too. SIGINT/SIGTERM stop the admission;
the rows running get ``drain_seconds`` to finish (a second signal stops at once), then the rest
are aborted and what is finished is written. An input that cannot be read on (a JSON array's broken
syntax, an I/O error) stops the admission too; the rows already read finish and are written.
"""
from __future__ import annotations

import collections
import signal
import threading
import time
from dataclasses import dataclass
from typing import Iterator, Optional

from pagedgen.cli import records
from pagedgen.cli.errors import CLIError, one_line
from pagedgen.cli.progress import Progress, RunStats
from pagedgen.cli.prompts import PromptSpec, Request, RequestBuilder
from pagedgen.cli.readers import Row
from pagedgen.cli.scoring import PairScorer
from pagedgen.cli.writer import RowWriter

READ_AHEAD = 64  # rows read and tokenized together before they are added one by one


class StopSignals:
    """While active, SIGINT and SIGTERM are recorded instead of raising or killing (main thread only)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._old: dict[int, object] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._record)
        return self

    def _record(self, signum, frame) -> None:
        self.received.append(signum)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


@dataclass
class Outcome:
    """How the loop ended: all rows done, a bad row (``--on-error stop``), or a signal."""

    bad_row: Optional[tuple[Row, str]] = None
    read_error: Optional[BaseException] = None  # the input could not be read on (CLIError or OSError)
    signal: Optional[int] = None
    aborted_rows: int = 0  # running or finished-but-unwritten rows dropped by an interruption

    @property
    def completed(self) -> bool:
        return self.bad_row is None and self.read_error is None and self.signal is None


@dataclass
class RunSettings:
    on_error: str  # "stop" or "skip"
    max_in_flight: int
    drain_seconds: float
    created: int  # Unix time for the OpenAI format's "created"
    model_name: str
    task: str = "generate"  # or a pooling task (--task embed / classify / reward)


def run_rows(llm, rows: Iterator[Row], builder: RequestBuilder, writer: RowWriter, spec: PromptSpec, settings: RunSettings,
             stats: RunStats, progress: Progress, signals: StopSignals, outcome: Outcome) -> None:
    """Generate for every row of ``rows`` (those not already done) and hand each result to
    ``writer``; ``outcome`` records a bad row (``--on-error stop``), a read error or a signal as soon as it happens."""
    engine = llm.llm_engine
    scorer = PairScorer(engine) if settings.task == "score" else None
    in_flight: dict[int, tuple[Row, Request]] = {}
    pending: collections.deque = collections.deque()  # (row, Request or why it cannot run), read ahead
    read_ahead = min(READ_AHEAD, settings.max_in_flight)
    exhausted = False
    deadline = None
    while True:
        while (outcome.bad_row is None and not signals.received
               and len(in_flight) < settings.max_in_flight and writer.can_admit()):
            if not pending:
                if exhausted:
                    break
                batch = []
                while len(batch) < read_ahead:
                    try:
                        row = next(rows, None)
                    except (CLIError, OSError) as exc:  # e.g. a JSON array's broken syntax: the rows before it still finish
                        outcome.read_error, row = exc, None
                    if row is None:
                        exhausted = True
                        break
                    batch.append(row)
                pending.extend(builder.build_many(batch))
                if not pending:
                    break
            row, built = pending.popleft()
            reason = built if isinstance(built, str) else _admit(engine, row, built, in_flight, settings.on_error == "skip", settings.task, scorer)
            if reason is None:
                writer.admit(row.index)
            elif settings.on_error == "skip":
                writer.admit(row.index)
                writer.finish(row.index, records.error_line(row, reason, spec), error=True)
                stats.bad += 1
            else:
                outcome.bad_row = (row, reason)
        if signals.received and outcome.signal is None:
            outcome.signal = signals.received[0]
            deadline = time.monotonic() + settings.drain_seconds
        if not in_flight:
            break
        if outcome.signal is not None and (len(signals.received) > 1 or time.monotonic() >= deadline):
            engine.abort_request([rid for i in in_flight for rid in (scorer.request_ids(i) if scorer else [str(i)])])
            if scorer:
                scorer.forget(list(in_flight))
            outcome.aborted_rows = len(in_flight) + writer.abandon()
            in_flight.clear()
            break
        for out in engine.step():
            if scorer is not None:  # --task score: a row is done when its pair's score is
                done = scorer.finish(out)
                if done is None:
                    continue
                index, out = done
                row, request = in_flight.pop(index)
            else:
                row, request = in_flight.pop(int(out.request_id))
            if getattr(out, "error", None) is not None:  # failed alone mid-generation (--on-error skip asked the engine to say so)
                writer.finish(row.index, records.error_line(row, f"row {row.index}: {out.error}", spec), error=True)
                stats.bad += 1
                continue
            if settings.task == "classify":  # the top label's name, from config.json id2label
                out.label = engine.pooling.id2label[int(out.outputs.data.argmax())]
            writer.finish(row.index, records.output_line(row, request, out, spec, settings.created, settings.model_name))
            stats.generated += 1
            stats.prompt_tokens += len(out.prompt_token_ids)
            stats.output_tokens += sum(len(c.token_ids) for c in out.outputs) if settings.task == "generate" else 0
        writer.maybe_flush()
        progress.update()


_POOLING_TASKS = {"embed": "embed", "classify": "classify", "reward": "token_classify"}  # --task -> pooling task


def _admit(engine, row: Row, request: Request, in_flight: dict, skip: bool, task: str = "generate",
           scorer: Optional[PairScorer] = None) -> Optional[str]:
    """Add ``row``'s request to the engine; None when added, else why the row cannot run. With
    ``skip`` (``--on-error skip``) a row that fails mid-generation comes back with its ``error``
    (``on_error="return"``) and goes to the errors file, its text kept for it; otherwise it ends as
    vLLM ends it (``LLM.generate``'s ``on_error``). ``task``: "generate", or the pooling task of
    ``--task`` (``_POOLING_TASKS``); ``scorer`` adds ``--task score``'s pairs."""
    try:
        if scorer is not None:
            scorer.add(row.index, request.prompt["pair"])
        elif task == "generate":
            engine.add_request(str(row.index), request.prompt, request.params, on_error="return" if skip else None, lora_request=request.lora)
        else:
            engine.add_pooling_request(str(row.index), request.prompt, None, _POOLING_TASKS[task])
    except (ValueError, TypeError) as exc:  # the engine's validation of the request
        reason = one_line(exc).replace(f"request {str(row.index)!r} ", f"row {row.index}'s ", 1)  # the CLI's term
        if "max_model_len" in reason and "prompt" in reason:
            reason += " (pass --truncate-prompt-tokens N to keep its last N tokens)"
        return reason
    in_flight[row.index] = (row, request)
    if not skip:
        row.span = b""  # hashed already; only a bad row's text is kept (for the errors file)
    return None
