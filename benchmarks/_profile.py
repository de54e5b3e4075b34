"""Where pagedgen's time goes: a per-component CPU-time breakdown of one ``LLM.generate`` call.

Used by ``benchmarks/throughput.py --profile`` (an extra, untimed pagedgen run after the timed ones)
and runnable alone on a checkpoint folder:

    python benchmarks/_profile.py MODEL_DIR [--num-prompts 64 --min-tokens 16 --max-tokens 64 --dtype bfloat16]

Method: cProfile with the calling thread's CPU time as its clock (``time.thread_time``) and torch
set to one thread, so that every instruction of the run, Python and kernels alike, is on the clock
and time slicing by other processes on a shared machine does not count. The cumulative time of a
few named functions gives the components (``COMPONENTS``): scheduling, step assembly (the step's
tensors), the forward pass split into its matmuls, lm_head and fused ops, sampling, appending tokens
(stop checks, detokenizer) and building outputs; "other" is the rest of the call (the engine loop,
the progress bar, per-step statistics). cProfile adds ~0.5 µs per Python call it sees, so the
Python-side shares read somewhat high; the forward's ops are timed exactly. A second, optional pass
with ``torch.profiler`` gives the top operators by self time (wall time of each op on one thread).
It runs the same call again, so with prefix caching on, the prompts' full blocks hit the cache and
most prompt prefill is skipped in that pass: its operator shares lean towards decode.
"""
from __future__ import annotations

import cProfile
import pstats
import time

# (label, parent label or None, [(path suffix, function name)]): a component's time is the
# cumulative time of its functions (summed); a child is part of its parent.
COMPONENTS = [
    ("scheduling", None, [("pagedgen/core/scheduler.py", "schedule")]),
    ("step assembly (step tensors, block moves)", None,
     [("pagedgen/worker/model_runner.py", "prepare"), ("pagedgen/worker/model_runner.py", "move_blocks")]),
    ("forward", None, [("pagedgen/model/base.py", "forward")]),
    ("  layer matmuls (linear)", "forward", [("pagedgen/layers/matmul/dispatch.py", "linear")]),
    ("  lm_head", "forward", [("pagedgen/layers/embedding.py", "forward@ParallelLMHead")]),
    ("  paged_attention", "forward", [("pagedgen/ops/__init__.py", "paged_attention")]),
    ("  reshape_and_cache", "forward", [("pagedgen/ops/__init__.py", "reshape_and_cache")]),
    ("  rms_norm + fused_add_rms_norm", "forward",
     [("pagedgen/ops/__init__.py", "rms_norm"), ("pagedgen/ops/__init__.py", "fused_add_rms_norm")]),
    ("  rotary_embedding", "forward", [("pagedgen/ops/__init__.py", "rotary_embedding")]),
    ("  silu_and_mul", "forward", [("pagedgen/ops/__init__.py", "silu_and_mul")]),
    ("sampling (incl. logprobs)", None, [("pagedgen/sample/sampler.py", "__call__")]),
    ("append tokens, stop checks, detokenize", None, [("pagedgen/core/sequence.py", "append_token")]),
    ("outputs (RequestOutput)", None, [("pagedgen/engine/processor.py", "make_output")]),
]
FORWARD_REST = "  other (embedding, residual adds, reshapes, Python)"
REST = "other (engine loop, statistics, progress bar)"
TOTAL = "total (CPU seconds, one thread)"


def _function_times(stats: pstats.Stats) -> dict:
    """{(path, function, line): (cumulative seconds, own seconds, calls, callers)} from pstats."""
    return {(path, func, line): (ct, tt, nc, callers) for (path, line, func), (_, nc, tt, ct, callers) in stats.stats.items()}


def _matches(path: str, func: str, suffix: str, name: str) -> bool:
    return path.replace("\\", "/").endswith(suffix) and func == name


def breakdown(stats: pstats.Stats, total: float, lm_head_line: int | None = None) -> list[dict]:
    """Components of a profiled run: [dict(component, seconds, share)], shares of ``total`` seconds.

    ``lm_head`` is told apart from other ``forward`` methods of embedding.py by its line number
    (``ParallelLMHead.forward``); the lm_head's own ``linear`` call is taken out of "layer matmuls".
    """
    times = _function_times(stats)
    seconds: dict[str, float] = {}
    head_linear = 0.0
    for label, _, funcs in COMPONENTS:
        s = 0.0
        for suffix, name in funcs:
            name, _, cls = name.partition("@")
            for (path, func, line), (ct, _, _, callers) in times.items():
                if not _matches(path, func, suffix, name):
                    continue
                if cls and line != lm_head_line:
                    continue
                s += ct
        seconds[label] = s
    # the lm_head's linear call is counted in the lm_head, not in the layer matmuls
    for (path, func, _), (_, _, _, callers) in times.items():
        if _matches(path, func, "pagedgen/layers/matmul/dispatch.py", "linear"):
            for (cpath, cline, cfunc), caller_stats in callers.items():
                if _matches(cpath, cfunc, "pagedgen/layers/embedding.py", "forward") and cline == lm_head_line:
                    head_linear += caller_stats[3]
    seconds["  layer matmuls (linear)"] -= head_linear
    forward_rest = seconds["forward"] - sum(seconds[label] for label, parent, _ in COMPONENTS if parent == "forward")
    rest = total - sum(seconds[label] for label, parent, _ in COMPONENTS if parent is None)
    labels = [label for label, _, _ in COMPONENTS]
    last_child = max(i for i, (_, parent, _) in enumerate(COMPONENTS) if parent == "forward")
    labels.insert(last_child + 1, FORWARD_REST)
    seconds[FORWARD_REST] = forward_rest
    labels += [REST, TOTAL]
    seconds[REST], seconds[TOTAL] = rest, total
    return [dict(component=label, seconds=seconds[label], share=seconds[label] / total if total else 0.0) for label in labels]


def _lm_head_line() -> int | None:
    from pagedgen.layers.embedding import ParallelLMHead

    return ParallelLMHead.forward.__code__.co_firstlineno


def profile_call(fn, torch_ops: bool = True, row_limit: int = 12) -> dict:
    """Run ``fn()`` twice: under cProfile (components) and, with ``torch_ops``, under torch.profiler.

    torch runs on one thread during both (restored after). Returns dict(components=breakdown rows,
    total_cpu_seconds, ops=[dict(op, self_cpu_seconds, calls, share)] or [], threads=1).
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        prof = cProfile.Profile(time.thread_time)
        start = time.thread_time()
        prof.runcall(fn)
        total = time.thread_time() - start
        rows = breakdown(pstats.Stats(prof), total, _lm_head_line())
        ops = []
        if torch_ops:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as tp:
                fn()
            averages = sorted(tp.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
            op_total = sum(e.self_cpu_time_total for e in averages) or 1.0
            ops = [dict(op=e.key, self_cpu_seconds=e.self_cpu_time_total / 1e6, calls=e.count, share=e.self_cpu_time_total / op_total)
                   for e in averages[:row_limit]]
    finally:
        torch.set_num_threads(threads)
    return dict(components=rows, total_cpu_seconds=total, ops=ops, threads=1)


def describe(profile: dict, say) -> None:
    """Print a profile of ``profile_call`` as two small tables."""
    say(f"profile of pagedgen (one extra untimed run, torch on 1 thread, CPU time of that thread; cProfile):")
    say(f"  {'component':<56}{'CPU s':>9}{'share':>8}")
    for r in profile["components"]:
        say(f"  {r['component']:<56}{r['seconds']:>9.3f}{r['share']:>8.1%}")
    if profile["ops"]:
        say("  top operators by self time (torch.profiler, a second run: wall time of each op on one thread, so it "
            "grows on a busy machine; the same prompts again, so prefix-cache hits skip most prompt prefill; share of all ops' self time):")
        for o in profile["ops"]:
            say(f"    {o['op']:<54}{o['self_cpu_seconds']:>9.3f}{o['share']:>8.1%}  ({o['calls']:,} calls)")


def main(argv=None) -> None:
    import argparse

    import _workload
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help=f"checkpoint folder or {' / '.join(_workload.RANDOM_MODELS)}")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else seeded sampling (seed = request index)")
    ap.add_argument("--no-torch-ops", action="store_true", help="skip the torch.profiler pass")
    args = ap.parse_args(argv)


    from transformers import AutoTokenizer

    from pagedgen import LLM, SamplingParams

    if args.model in _workload.RANDOM_MODELS:
        args.model, _ = _workload.ensure_random_model(args.model, "bfloat16" if args.dtype == "auto" else args.dtype)
    tok = AutoTokenizer.from_pretrained(args.model)
    prompts, limits = _workload.load_workload("tinystories", tok, num_prompts=args.num_prompts, min_tokens=args.min_tokens,
                                              max_tokens=args.max_tokens, max_prompt_tokens=None, max_model_len=2048, seed=0)
    llm = LLM(args.model, dtype=args.dtype)
    vocab = llm.llm_engine.model_runner.model.config.vocab_size
    prompts, _ = _workload.fold_ids(prompts, vocab)
    params = [SamplingParams(temperature=args.temperature, max_tokens=m, ignore_eos=True,
                             seed=i if args.temperature else None) for i, m in enumerate(limits)]
    llm.generate(_workload.warmup_prompts(prompts), SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    prof = profile_call(lambda: llm.generate(prompts, params, use_tqdm=False), torch_ops=not args.no_torch_ops)
    describe(prof, print)
    print(f"torch {torch.__version__}; {sum(limits):,} output tokens")


if __name__ == "__main__":
    main()
