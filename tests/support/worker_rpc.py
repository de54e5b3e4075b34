"""Helpers of the worker-process tests (test_executor.py, test_tensor_parallel.py,
test_pipeline_parallel.py): functions run inside the workers through ``collective_rpc`` (module
level, so that they pickle by name), the driver-side checks that worker processes are gone, and
the mixed batch that test_executor.py runs through each boundary and test_pipeline_parallel.py at
PP = 2 (``MIXED``, ``run_mixed``)."""
import os
import time

from pagedgen import LLM, SamplingParams, StructuredOutputsParams
from pagedgen.beam_search import BeamSearchParams


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


MIXED = [
    SamplingParams(temperature=0, max_tokens=16),
    SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=16, logprobs=2),
    SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=10, presence_penalty=0.4),
    SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=3, min_tokens=4),
    # the grammar bitmask crosses the boundary with the step record
    SamplingParams(temperature=1.0, seed=5, max_tokens=12, structured_outputs=StructuredOutputsParams(regex=r"(yes|no)( (yes|no))*")),
]


def run_mixed(llm: LLM, prompts: list[str]):
    outs = llm.generate(prompts, [MIXED[i % len(MIXED)] for i in range(len(prompts))], use_tqdm=False)
    beams = llm.beam_search(prompts[:2], BeamSearchParams(beam_width=3, max_tokens=8))
    return (
        [[(c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason) for c in o.outputs] for o in outs],
        [o.prompt_logprobs for o in outs],
        [[(s.tokens, s.cum_logprob) for s in b.sequences] for b in beams],
    )


def int8_shapes(worker) -> dict:
    """{module name: (weight dtype, weight_scale shape, input_scale shape or None)} of this worker's
    int8 linear layers (issue 46: each tensor-parallel rank holds its shard of weights and scales)."""
    return {n: (str(m.weight.dtype), tuple(m.weight_scale.shape), None if m.input_scale is None else tuple(m.input_scale.shape))
            for n, m in worker.runner.model.named_modules() if getattr(m, "weight_scale", None) is not None}


def int4_shapes(worker) -> dict:
    """{module name: (weight shape, weight_scale shape, group)} of this worker's int4 linear layers
    (issue 46: each tensor-parallel rank holds its shard of the codes, scales and zeros)."""
    return {n: (tuple(m.weight.shape), tuple(m.weight_scale.shape), m.int4_group)
            for n, m in worker.runner.model.named_modules() if getattr(m, "int4_group", 0)}
