"""``MultiprocExecutor``: the worker in its own process (``distributed_executor_backend="mp"``).

The driver sends each step's ``StepRecord`` down a pipe and waits for the ``StepReply``, polling
the pipe and the worker's liveness every 50 ms: a worker that dies (killed, out of memory, a crash
in native code) makes the waiting call raise ``RuntimeError`` naming its rank, pid and exit code
within a fraction of a second, and the other workers are stopped; the executor then refuses every
call (make a new ``LLM``). A worker that raises sends a ``WorkerError`` and stays up: the call
raises ``RuntimeError`` with the worker's traceback, the engine rolls back, and the next record
frees every sequence the worker held.

Life cycle and interrupts:
- workers ignore SIGINT (a Ctrl-C in a terminal reaches the whole process group): the driver alone
  decides. A Ctrl-C while the driver waits stops the call; the worker finishes its step, and its
  late reply is dropped by the next call (every message and reply carries an id). A Ctrl-C that
  lands inside a pipe read or write may leave half a message in the pipe: the workers are then
  replaced (a fresh process, the model loaded again) before the next step.
- ``shutdown()`` (``LLM.shutdown()``, leaving ``with LLM(...)``), garbage collection of the
  executor and interpreter exit all end the workers: a ``Shutdown`` message, then terminate, then
  kill, each after a grace period. A worker whose driver dies sees its pipe close and exits.
"""
from __future__ import annotations

import itertools
import os
import signal
import threading
import time
import traceback
import weakref
from typing import Callable, Optional

import torch.multiprocessing as mp

from pagedgen.engine.model_runner import StepOutput
from pagedgen.engine.scheduler_output import ScheduledBatch
from pagedgen.engine.sequence import Sequence
from pagedgen.executor.messages import RpcReply, RunOnWorker, Shutdown, StepRecord, StepReply, WorkerError, WorkerReady
from pagedgen.executor.uniproc import RecordBuilder
from pagedgen.executor.worker import Worker, WorkerSpec, output_of

POLL_S = 0.05  # how often a waiting driver checks that its workers are alive
START_TIMEOUT_S = 600.0  # loading a model may take minutes; a worker that dies while loading is seen at once


def worker_main(spec: WorkerSpec, rank: int, conn) -> None:
    """A worker process: build the worker, then answer messages until ``Shutdown`` or until the
    driver's end of the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    try:
        worker = Worker(spec, rank)
    except BaseException as exc:  # noqa: BLE001 - reported to the driver, which raises
        _send(conn, WorkerError(rank, -1, type(exc).__name__, str(exc), traceback.format_exc()))
        return
    if not _send(conn, WorkerReady(rank, os.getpid())):
        return
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the driver is gone
            return
        if isinstance(msg, Shutdown):
            return
        call_id = msg.step_id if isinstance(msg, StepRecord) else msg.call_id
        try:
            if isinstance(msg, StepRecord):
                reply = worker.execute(msg)
            elif isinstance(msg, RunOnWorker):
                reply = RpcReply(msg.call_id, msg.fn(worker, *msg.args))
            else:
                raise TypeError(f"unknown message {type(msg).__name__}")
        except Exception as exc:  # noqa: BLE001 - the driver raises it
            reply = WorkerError(rank, call_id, type(exc).__name__, str(exc), traceback.format_exc())
        try:
            if not _send(conn, reply):
                return
        except Exception as exc:  # noqa: BLE001 - a reply that does not pickle (nothing was written yet)
            if not _send(conn, WorkerError(rank, call_id, type(exc).__name__, f"the reply could not be sent: {exc}", traceback.format_exc())):
                return


def _send(conn, msg) -> bool:
    try:
        conn.send(msg)
        return True
    except (BrokenPipeError, EOFError, OSError):
        return False


def _reply_id(reply) -> int:
    return reply.step_id if isinstance(reply, StepReply) else reply.call_id


def _stop(procs: list, conns: list, grace_s: float = 5.0) -> None:
    """End worker processes: ask, then terminate, then kill (each after a grace period)."""
    for conn in conns:
        _send(conn, Shutdown())
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(1.0)
        if proc.is_alive():
            proc.kill()
            proc.join(1.0)
    for conn in conns:
        conn.close()


def _describe_exit(code: Optional[int]) -> str:
    if code is None:
        return "closed its pipe"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class MultiprocExecutor:
    """One worker process (rank 0), spawned with torch.multiprocessing.

    Args:
        spec: what the worker builds (model, device, cache, seed).
        world_size: worker processes (1: tensor and pipeline parallelism are not built yet).
    """

    def __init__(self, spec: WorkerSpec, world_size: int = 1) -> None:
        self.spec = spec
        self.world_size = world_size
        self.model_runner = None  # the model lives in the worker
        self._records = RecordBuilder()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._procs: list = []
        self._conns: list = []
        self._dead: Optional[str] = None  # why the executor refuses calls
        self._desynced = False  # a pipe read or write was interrupted: replace the workers
        self._finalizer = None
        self._start()

    # ----- the executor API ----------------------------------------------------------------------
    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def execute(self, batch: ScheduledBatch, seqs: dict[int, Sequence]) -> StepOutput:
        self._ready()
        step_id = next(self._ids)
        reply = self._call(self._records.build(step_id, batch), step_id, f"step {step_id}")[0]
        return output_of(reply, seqs)

    def collective_rpc(self, fn: Callable, args: tuple = ()) -> list:
        """``fn(worker, *args)`` on every worker (``fn`` must be picklable: a module-level
        function); their return values, by rank."""
        self._ready()
        call_id = next(self._ids)
        return [r.value for r in self._call(RunOnWorker(call_id, fn, tuple(args)), call_id, f"collective_rpc({getattr(fn, '__name__', fn)})")]

    def shutdown(self) -> None:
        """End the workers (idempotent); later calls raise RuntimeError."""
        if self._dead is None:
            self._dead = "the LLM was shut down (LLM.shutdown()): make a new LLM"
        if self._finalizer is not None:
            self._finalizer()

    # ----- internals -----------------------------------------------------------------------------
    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        procs, conns = [], []
        self._procs, self._conns = procs, conns
        self._finalizer = weakref.finalize(self, _stop, procs, conns)
        for rank in range(self.world_size):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(self.spec, rank, child_end), name=f"pagedgen-worker-{rank}", daemon=True)
            proc.start()
            child_end.close()
            procs.append(proc)
            conns.append(parent_end)
        for rank, conn in enumerate(conns):
            msg = self._wait(rank, conn, lambda m: True, "starting", START_TIMEOUT_S)
            if isinstance(msg, WorkerError):
                self._fail(rank, "starting", f"raised {msg.exc_type}: {msg.message}\n--- worker traceback ---\n{msg.traceback}")
            if not isinstance(msg, WorkerReady):
                self._fail(rank, "starting", f"sent {type(msg).__name__} instead of WorkerReady")

    def _ready(self) -> None:
        if self._dead is not None:
            raise RuntimeError(self._dead)
        if self._desynced:  # an interrupted pipe read or write: start over with fresh workers
            self._finalizer()
            self._records.reset()
            self._desynced = False
            self._start()

    def _call(self, msg, call_id: int, what: str) -> list:
        with self._lock:
            for rank, conn in enumerate(self._conns):
                try:
                    sent = _send(conn, msg)
                except BaseException:
                    self._desynced = True  # half a message may be in the pipe
                    raise
                if not sent:
                    self._fail(rank, what, _describe_exit(self._exitcode(rank)))
            replies = []
            for rank, conn in enumerate(self._conns):
                reply = self._wait(rank, conn, lambda r: _reply_id(r) >= call_id, what)
                if isinstance(reply, WorkerError):
                    raise RuntimeError(
                        f"pagedgen worker rank {rank} raised {reply.exc_type} in {what}: {reply.message}\n"
                        f"--- worker traceback ---\n{reply.traceback}"
                    )
                replies.append(reply)
            return replies

    def _wait(self, rank: int, conn, wanted: Callable, what: str, timeout_s: Optional[float] = None):
        """The next message of ``rank`` that ``wanted`` accepts (older replies are dropped);
        RuntimeError if the worker dies first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            ready = conn.poll(POLL_S)  # an interrupt here leaves the pipe whole
            if ready:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    self._fail(rank, what, _describe_exit(self._exitcode(rank)))
                except BaseException:
                    self._desynced = True  # half a message may be left in the pipe
                    raise
                if wanted(msg):
                    return msg
                continue
            if not self._procs[rank].is_alive():
                self._fail(rank, what, _describe_exit(self._exitcode(rank)))
            if deadline is not None and time.monotonic() > deadline:
                self._fail(rank, what, f"did not answer within {timeout_s:.0f} s")

    def _exitcode(self, rank: int) -> Optional[int]:
        proc = self._procs[rank]
        proc.join(0.5)
        return proc.exitcode

    def _fail(self, rank: int, what: str, how: str) -> None:
        pid = self._procs[rank].pid
        self._dead = f"pagedgen worker rank {rank} (pid {pid}) {how} during {what}; the workers were stopped: make a new LLM"
        self._finalizer()  # no orphans: stop the other workers too
        raise RuntimeError(self._dead)
