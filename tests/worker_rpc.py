"""Functions the executor tests run inside worker processes through ``collective_rpc`` (module
level, so that they pickle by name): slow every step down, and undo it; the fault and Ctrl-C tests
of test_executor.py, test_tensor_parallel.py and test_pipeline_parallel.py use them."""
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
