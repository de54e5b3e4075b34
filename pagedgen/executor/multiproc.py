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
  kill, each after a grace period. A worker whose driver dies exits at once, mid-step too
  (``exit_with_driver``).
"""
from __future__ import annotations

import itertools
import multiprocessing
import multiprocessing.connection as mp_connection
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
import traceback
import weakref
from typing import Callable, Optional

import torch.multiprocessing as mp

from pagedgen.core.scheduler_output import ScheduledBatch
from pagedgen.core.sequence import Sequence
from pagedgen.executor.messages import RpcReply, RunOnWorker, Shutdown, StepRecord, StepReply, WorkerError, WorkerReady
from pagedgen.executor.uniproc import RecordBuilder
from pagedgen.worker.model_runner import StepOutput
from pagedgen.worker.worker import Worker, WorkerSpec, output_of

POLL_S = 0.05  # how often a waiting driver checks that its workers are alive
START_TIMEOUT_S = 600.0  # loading a model may take minutes; a worker that dies while loading is seen at once


def worker_main(spec: WorkerSpec, rank: int, conn, store_path: Optional[str] = None) -> None:
    """A worker process: build the worker, then answer messages until ``Shutdown`` or until the
    driver's end of the pipe closes; it also ends as soon as its driver does (``exit_with_driver``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    exit_with_driver(os.path.dirname(store_path) if store_path else None)
    try:
        worker = Worker(spec, rank, store_path)
    except BaseException as exc:  # noqa: BLE001 - reported to the driver, which raises
        _send(conn, WorkerError(rank, -1, type(exc).__name__, str(exc), traceback.format_exc()))
        return
    if not _send(conn, WorkerReady(rank, os.getpid(), worker.tp.comm.name if worker.tp is not None else "", worker.transfer)):
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


def exit_with_driver(group_dir: Optional[str] = None) -> None:
    """End this worker process the moment its driver (the process that spawned it) ends, whatever
    it is doing: a daemon thread waits on the parent's sentinel. Between steps a worker sees its
    pipe close; mid-step it may wait in a collective for a rank that never got the step (the driver
    killed between sending the record to one rank and the next), and would spin there forever.
    ``group_dir``: the group's folder in /dev/shm (the all-reduce's and the stages' files), which a
    driver killed with SIGKILL cannot remove: the workers do."""
    parent = multiprocessing.parent_process()
    if parent is None:  # not a spawned child (called in the driver): nothing to watch
        return

    def watch() -> None:
        mp_connection.wait([parent.sentinel])
        if group_dir:
            shutil.rmtree(group_dir, ignore_errors=True)
        os._exit(1)  # no one is left to report to

    threading.Thread(target=watch, name="pagedgen-driver-watch", daemon=True).start()


def _send(conn, msg) -> bool:
    try:
        conn.send(msg)
        return True
    except (BrokenPipeError, EOFError, OSError):
        return False


def _send_bytes(conn, data: bytes) -> bool:
    try:
        conn.send_bytes(data)
        return True
    except (BrokenPipeError, EOFError, OSError):
        return False


def _reply_id(reply) -> int:
    return reply.step_id if isinstance(reply, StepReply) else reply.call_id


def _stop(procs: list, conns: list, tmpdir: Optional[str] = None, grace_s: float = 5.0) -> None:
    """End worker processes: ask, then terminate, then kill (each after a grace period); remove
    the group's temporary folder."""
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
    if tmpdir is not None:
        shutil.rmtree(tmpdir, ignore_errors=True)


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
    """``spec.world_size`` worker processes (ranks 0 .. N - 1, ``rank = pp_rank *
    tensor_parallel_size + tp_rank``), spawned with torch.multiprocessing; each holds its shard of
    the weights and of the KV cache (its heads, its pipeline stage's layers). Every record goes to
    every rank (pickled once); every rank answers (so that an error anywhere is seen), and the
    reply of the output rank, TP rank 0 of the last pipeline stage, is the step's: the last
    stage's ranks hold the same gathered logits and draw the same tokens
    (``PAGEDGEN_TP_CHECK=1`` asserts that their replies are equal).

    Args:
        spec: what the workers build (model, device, cache, seed, tensor-parallel size).
    """

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.world_size = spec.world_size
        self.output_rank = (spec.pipeline_parallel_size - 1) * spec.tensor_parallel_size  # TP rank 0 of the last stage
        self._check_replies = os.environ.get("PAGEDGEN_TP_CHECK", "") not in ("", "0")
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
        reply = self._call(self._records.build(step_id, batch), step_id, f"step {step_id}")[self.output_rank]
        return output_of(reply, seqs)

    def collective_rpc(self, fn: Callable, args: tuple = ()) -> list:
        """``fn(worker, *args)`` on every worker (``fn`` must be picklable: a module-level
        function); their return values, by rank."""
        self._ready()
        call_id = next(self._ids)
        return [r.value for r in self._call(RunOnWorker(call_id, fn, tuple(args)), call_id, f"collective_rpc({getattr(fn, '__name__', fn)})")]

    def check_usable(self) -> None:
        """RuntimeError (why) once the executor refuses calls: shut down, or a worker died; the
        engine checks it before it queues a request, so none is queued for workers that are gone."""
        if self._dead is not None:
            raise RuntimeError(self._dead)

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
        shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") else None  # the shared-memory all-reduce's file lives here
        tmpdir = tempfile.mkdtemp(prefix="pagedgen-tp-", dir=shm_dir) if self.world_size > 1 else None
        store_path = os.path.join(tmpdir, "store") if tmpdir else None  # torch.distributed's file store
        self._finalizer = weakref.finalize(self, _stop, procs, conns, tmpdir)
        for rank in range(self.world_size):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(self.spec, rank, child_end, store_path), name=f"pagedgen-worker-{rank}", daemon=True)
            proc.start()
            child_end.close()
            procs.append(proc)
            conns.append(parent_end)
        self._wait_started()

    def _wait_started(self) -> None:
        """Every rank's ``WorkerReady``, read as they come, watching every rank that has not
        answered yet: a rank that dies or raises while starting fails the start at once (waiting
        on rank 0 alone left the driver blocked for ``START_TIMEOUT_S`` while rank 0 waited for
        the dead rank in the group's rendezvous)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        pending = {conn: rank for rank, conn in enumerate(self._conns)}
        while pending:
            for conn in mp_connection.wait(list(pending), POLL_S):
                rank = pending.pop(conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    self._fail(rank, "starting", _describe_exit(self._exitcode(rank)))
                if isinstance(msg, WorkerError):
                    self._fail(rank, "starting", f"raised {msg.exc_type}: {msg.message}\n--- worker traceback ---\n{msg.traceback}")
                if not isinstance(msg, WorkerReady):
                    self._fail(rank, "starting", f"sent {type(msg).__name__} instead of WorkerReady")
                if rank == 0:
                    self.communicator = msg.communicator  # which all-reduce the ranks use ("shm", "gloo")
                    self.transfer = msg.transfer  # how the pipeline stages hand on activations ("shm", "gloo")
            for rank in sorted(pending.values()):
                if not self._procs[rank].is_alive():
                    self._fail(rank, "starting", _describe_exit(self._exitcode(rank)))
            if pending and time.monotonic() > deadline:
                self._fail(min(pending.values()), "starting", f"did not answer within {START_TIMEOUT_S:.0f} s")

    def _ready(self) -> None:
        self.check_usable()
        if self._desynced:  # an interrupted pipe read or write: start over with fresh workers
            self._finalizer()
            self._records.reset()
            self._start()
            self._desynced = False  # only once they all started (an interrupt in between: start over again)

    def _call(self, msg, call_id: int, what: str) -> list:
        with self._lock:
            data = pickle.dumps(msg) if self.world_size > 1 else None  # one pickle for every rank
            try:
                for rank, conn in enumerate(self._conns):
                    sent = _send(conn, msg) if data is None else _send_bytes(conn, data)
                    if not sent:
                        self._fail(rank, what, _describe_exit(self._exitcode(rank)))
            except BaseException:
                # half a message may be in a pipe, or some ranks got the record and others not (an
                # interrupt between two sends): ranks that wait for each other in a collective or for
                # a stage's activations would pair different steps. Start over with fresh workers.
                self._desynced = True
                raise
            if self.world_size == 1:
                replies = [self._wait(0, self._conns[0], lambda r: _reply_id(r) >= call_id, what)]
            else:
                replies = self._wait_all(call_id, what)
            for rank, reply in enumerate(replies):
                if isinstance(reply, WorkerError):
                    if self.world_size > 1:  # the other ranks may wait in a collective: start them over
                        self._restart_later()
                    raise RuntimeError(
                        f"pagedgen worker rank {rank} raised {reply.exc_type} in {what}: {reply.message}\n"
                        f"--- worker traceback ---\n{reply.traceback}"
                    )
            out = self.output_rank
            if self._check_replies and isinstance(replies[out], StepReply):
                for rank in range(out + 1, self.world_size):  # the last stage's other TP ranks
                    reply = replies[rank]
                    if (reply.seq_ids, reply.token_ids) != (replies[out].seq_ids, replies[out].token_ids):
                        raise AssertionError(f"tensor-parallel rank {rank} sampled {reply.token_ids}, rank {out} {replies[out].token_ids} in {what}")
            return replies

    def _wait_all(self, call_id: int, what: str) -> list:
        """Every rank's answer to ``call_id``, read as they come (a rank that raised may leave the
        others waiting in a collective: its error is seen at once); RuntimeError naming a rank that
        dies first."""
        replies: list = [None] * self.world_size
        pending = {conn: rank for rank, conn in enumerate(self._conns)}
        while pending:
            for conn in mp_connection.wait(list(pending), POLL_S):
                rank = pending[conn]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    self._fail(rank, what, _describe_exit(self._exitcode(rank)))
                except BaseException:
                    self._desynced = True
                    raise
                if _reply_id(msg) < call_id:
                    continue  # a late reply to an interrupted call
                replies[rank] = msg
                del pending[conn]
                if isinstance(msg, WorkerError):
                    return replies
            for rank, proc in enumerate(self._procs):
                if not proc.is_alive():
                    self._fail(rank, what, _describe_exit(self._exitcode(rank)))
        return replies

    def _restart_later(self) -> None:
        """Stop the workers now (no orphan waits in a collective); the next call starts fresh ones."""
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        self._finalizer()
        self._desynced = True

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
        """Stop every worker (no orphan waits in a collective for the dead one) and raise
        RuntimeError naming ``rank``, its pid and ``how`` it failed during ``what``. A rank that
        dies during a call is restarted for the next call, as a rank that raises is (the engine
        rolls the step back: the next call equals a fresh LLM's); one that fails ``"starting"``
        leaves the executor refusing calls (starting again would fail the same way)."""
        pid = self._procs[rank].pid
        why = f"pagedgen worker rank {rank} (pid {pid}) {how} during {what}; the workers were stopped"
        if what == "starting":
            self._dead = why + ": make a new LLM"
            if how == _describe_exit(1):  # died before worker_main could report anything
                self._dead += (" (its traceback is above; the usual cause: a script that makes the LLM at its top level, which each "
                               'spawned worker runs again as it starts: put that code under `if __name__ == "__main__":`)')
        for other in self._procs:  # the others may wait in a collective for the dead one
            if other.is_alive() and self.world_size > 1:
                other.terminate()
        self._finalizer()  # no orphans: stop the other workers too
        if what == "starting":
            raise RuntimeError(self._dead)
        self._desynced = True  # the next call starts fresh workers (_ready)
        raise RuntimeError(why + " (the next call starts fresh ones)")
