"""Per-step recording of the engine: what each step ran, and what the KV cache held.

``LLM.start_recording()`` hands the engine a ``StepLog``; the engine then makes one ``record`` call
per step, and ``LLM.stop_recording()`` takes it away again. While no log is set, the engine pays one
``is None`` test per step. A record appends eleven numbers to typed arrays (``array.array``, about
90 bytes a step), most of them counters the scheduler and block manager keep anyway; per-step
figures are differences of those running counters, taken when the log is read. No tensors.

Read the columns as NumPy arrays (one entry per recorded step), e.g. for the PagedAttention paper's
figure-2 view of the cache over time::

    log = llm.start_recording()
    llm.generate(prompts, params)
    llm.stop_recording()
    log.kv_utilization, log.kv_usage, log.num_running   # [num_steps] arrays
    pagedgen.plot.steps(log)                           # the same, drawn
"""
from __future__ import annotations

import time
from array import array
import numpy as np

# name -> (array typecode, meaning); the raw columns one record appends to, in this order
_RAW = {
    "time_s": ("d", "seconds since recording started, at the end of the step"),
    "num_running": ("q", "sequences holding KV blocks on the device in the step (incl. those that finished in it)"),
    "num_waiting": ("q", "sequences queued for admission (new or preempted for recompute) after scheduling"),
    "num_swapped": ("q", "sequences whose KV blocks sit in CPU swap space after scheduling"),
    "num_used_blocks": ("q", "KV blocks owned by sequences in the step"),
    "num_used_slots": ("q", "token slots of those blocks that hold real tokens"),
    "prefill_total": ("q", "running count of prefill tokens (prompt and recomputed tokens)"),
    "decode_total": ("q", "running count of decode tokens"),
    "preemption_total": ("q", "running count of preemptions (recompute and swap)"),
    "generated_total": ("q", "running count of sampled tokens"),
    "num_finished": ("q", "sequences that finished in the step"),
}


class StepLog:
    """Figures of every engine step since ``LLM.start_recording()``.

    Args:
        scheduler: the engine's ``Scheduler`` (queues and its running token / preemption counters).
        block_manager: the engine's device ``BlockManager``.
        num_generated_tokens: the engine's count of sampled tokens when recording starts.

    Columns (``numpy.ndarray`` of shape ``[len(log)]``; int64 unless noted):
        time_s (float64): seconds since recording started, at the end of each step.
        num_running, num_waiting, num_swapped: sequences running in the step, queued for admission,
            swapped out to CPU memory.
        num_used_blocks: KV blocks in use; ``kv_usage`` (float64) = num_used_blocks / num_kv_blocks.
        kv_utilization (float64): slots holding real tokens / slots of the blocks in use (the
            paper's figure 2 measure, as in ``EngineStats.kv_utilization``; 1.0 for an empty step).
        num_prefill_tokens, num_decode_tokens: tokens computed in the step, by kind.
        num_generated_tokens: tokens sampled in the step.
        num_preemptions: sequences preempted in the step (recompute or swap).
        num_finished: sequences that finished in the step.
    Constants: ``num_kv_blocks`` and ``block_size`` of the cache, ``max_num_seqs``.
    """

    def __init__(self, scheduler, block_manager, num_generated_tokens: int = 0) -> None:
        self._scheduler = scheduler
        self._block_manager = block_manager
        self.num_kv_blocks: int = block_manager.num_blocks
        self.block_size: int = block_manager.block_size
        self.max_num_seqs: int = scheduler.config.max_num_seqs
        s = scheduler.stats
        # running counters when recording started: the first step's figures are taken from these
        self._base = {"prefill_total": s.num_prefill_tokens, "decode_total": s.num_decode_tokens,
                      "preemption_total": s.num_preemptions, "generated_total": num_generated_tokens}
        self._cols = {name: array(code) for name, (code, _) in _RAW.items()}
        self._start = time.perf_counter()
        self.recording = True

    def record(self, num_generated_tokens: int, num_finished: int) -> None:
        """Append the figures of the step that just ran. Called by the engine once per step,
        after the model step and before finished sequences free their blocks.

        Args:
            num_generated_tokens: the engine's running count of sampled tokens.
            num_finished: sequences that finished in this step.
        """
        sched, bm, c = self._scheduler, self._block_manager, self._cols
        s = sched.stats
        c["time_s"].append(time.perf_counter() - self._start)
        c["num_running"].append(len(sched.running))
        c["num_waiting"].append(len(sched.waiting))
        c["num_swapped"].append(len(sched.swapped))
        c["num_used_blocks"].append(bm.num_used_blocks)
        c["num_used_slots"].append(bm.num_used_slots)
        c["prefill_total"].append(s.num_prefill_tokens)
        c["decode_total"].append(s.num_decode_tokens)
        c["preemption_total"].append(s.num_preemptions)
        c["generated_total"].append(num_generated_tokens)
        c["num_finished"].append(num_finished)

    def stop(self) -> None:
        """No more records (``LLM.stop_recording()`` calls this); what was recorded stays readable."""
        self.recording = False
        self._scheduler = self._block_manager = None

    # ----- reading ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._cols["time_s"])

    def _raw(self, name: str) -> np.ndarray:
        return np.array(self._cols[name], dtype=np.float64 if _RAW[name][0] == "d" else np.int64)

    def _per_step(self, name: str) -> np.ndarray:
        """Per-step amounts from a running counter: differences, the first from the start value."""
        return np.diff(self._raw(name), prepend=self._base[name])

    time_s = property(lambda self: self._raw("time_s"), doc=_RAW["time_s"][1])
    num_running = property(lambda self: self._raw("num_running"), doc=_RAW["num_running"][1])
    num_waiting = property(lambda self: self._raw("num_waiting"), doc=_RAW["num_waiting"][1])
    num_swapped = property(lambda self: self._raw("num_swapped"), doc=_RAW["num_swapped"][1])
    num_used_blocks = property(lambda self: self._raw("num_used_blocks"), doc=_RAW["num_used_blocks"][1])
    num_finished = property(lambda self: self._raw("num_finished"), doc=_RAW["num_finished"][1])
    num_prefill_tokens = property(lambda self: self._per_step("prefill_total"), doc="prefill tokens computed in the step")
    num_decode_tokens = property(lambda self: self._per_step("decode_total"), doc="decode tokens computed in the step")
    num_generated_tokens = property(lambda self: self._per_step("generated_total"), doc="tokens sampled in the step")
    num_preemptions = property(lambda self: self._per_step("preemption_total"), doc="sequences preempted in the step")

    @property
    def kv_usage(self) -> np.ndarray:
        """Share of the KV cache's blocks in use, per step (float64, 0..1)."""
        return self._raw("num_used_blocks") / self.num_kv_blocks

    @property
    def kv_utilization(self) -> np.ndarray:
        """Slots holding real tokens / slots of the blocks in use, per step (float64; 1.0 when no
        block is in use)."""
        slots = self._raw("num_used_blocks") * self.block_size
        return np.divide(self._raw("num_used_slots"), slots, out=np.ones(len(self)), where=slots > 0)

    COLUMNS = ("time_s", "num_running", "num_waiting", "num_swapped", "num_used_blocks", "kv_usage", "kv_utilization",
               "num_prefill_tokens", "num_decode_tokens", "num_generated_tokens", "num_preemptions", "num_finished")

    def to_dict(self) -> dict[str, list]:
        """Every column as a plain list, e.g. for ``pandas.DataFrame(log.to_dict())`` or JSON."""
        return {name: getattr(self, name).tolist() for name in self.COLUMNS}

    def __repr__(self) -> str:
        n = len(self)
        state = "recording" if self.recording else "stopped"
        if not n:
            return f"StepLog(0 steps, {state})"
        util = self.kv_utilization
        return (f"StepLog({n} steps over {self._cols['time_s'][-1]:.2f} s, {state}; peak running {max(self._cols['num_running'])}, "
                f"peak KV blocks {max(self._cols['num_used_blocks'])}/{self.num_kv_blocks}, "
                f"KV utilisation mean {util.mean():.1%}, {int(self.num_preemptions.sum())} preemptions, "
                f"{int(self.num_generated_tokens.sum()):,} tokens generated)")

    def _repr_pretty_(self, p, cycle: bool) -> None:
        p.text(repr(self))

