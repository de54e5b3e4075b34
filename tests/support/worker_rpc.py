"""Helpers of the worker-process tests (test_executor.py, test_tensor_parallel.py,
test_pipeline_parallel.py): functions run inside the workers through ``collective_rpc`` (module
level, so that they pickle by name), and the driver-side checks that worker processes are gone."""
import os
import time


def slow_steps(worker, seconds: float) -> int:
    """Every forward of this worker's model sleeps ``seconds`` first; returns the worker's pid."""
    model = worker.runner.model
    real = type(model).forward

    def slow(self, *args, **kwargs):
        time.sleep(seconds)
        return real(self, *args, **kwargs)

    model.forward = slow.__get__(model)
    return os.getpid()


def normal_steps(worker) -> None:
    """Undo ``slow_steps``."""
    worker.runner.model.__dict__.pop("forward", None)


def fail_steps(worker, rank: int, message: str) -> None:
    """Every forward of worker ``rank`` raises ValueError(message) (other ranks are left alone)."""
    if worker.rank != rank:
        return

    def failing(*args, **kwargs):
        raise ValueError(message)

    worker.runner.model.forward = failing


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids, timeout_s: float = 10.0) -> bool:
    """Whether every process of ``pids`` is gone within ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(alive(p) for p in pids)
