"""Speculative decoding (issue 34): output tok/s with speculation on vs off, side by side in one run,
and the acceptance rate by draft position.

    python benchmarks/speculative.py                 # the issue's cases (minutes on a CPU)
    python benchmarks/speculative.py --draft-model   # the draft-model cases only
    python benchmarks/speculative.py --tiny          # a smoke run (seconds)
    python benchmarks/speculative.py --case stories --batches 4 8 --num-prompts 16 --max-tokens 64
    python benchmarks/speculative.py --case stories --batches 8 --profile   # where a step's time goes, off vs on
    python benchmarks/speculative.py --repeats 5                  # each case 5 times, interleaved: medians
    python benchmarks/speculative.py --case random --batches 8 --bound   # GEMMs vs the matmul peak: the ceiling

Cases: random-135m bf16 greedy (its outputs repeat themselves, so lookup proposes right tokens) at
batch 1, 4 and 8; stories260K on prompts that end by restarting a passage they contain (lookup
mostly misses: the cost of a miss); batch 256 with disable_by_batch_size=64 (speculation off at full
batch). Draft model: stories260K with early-exit drafts of its own first two and four layers
(``pagedgen.spec_decode.early_exit``, written to a temporary folder) and stories260K as its own draft
(every draft accepted: the upper bound of the mechanism) on TinyStories openings, greedy, at batch
1, 4 and 8. Each line: batch, tok/s off, tok/s on, ratio, accepted / proposed, acceptance by
position, and whether the outputs equal speculation off (they must: greedy).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _workload import RANDOM_MODELS, SHARED, ensure_random_model, fold_ids, gpt2_tokenizer_dir  # noqa: E402

from pagedgen import LLM, SamplingParams  # noqa: E402
from pagedgen.spec_decode.early_exit import write_early_exit_draft  # noqa: E402

STORIES = os.path.join(SHARED, "models", "stories260K")
BOUND = False  # --bound: each case prints its GEMM ceiling (``bound``) instead of its timing
TINYSTORIES = os.path.join(SHARED, "data", "tinystories_valid_first1000", "tinystories_valid_first1000.jsonl")


def restart_prompts(n: int, words: int) -> list[str]:
    """Story openings of ``words`` words followed by their own first few words again."""
    out = []
    with open(TINYSTORIES) as f:
        for line in f:
            text = " ".join(json.loads(line)["text"].split()[:words])
            out.append(text + " " + " ".join(text.split()[:6]))
            if len(out) == n:
                break
    return out


def openings(n: int, words: int) -> list[str]:
    """The first ``words`` words of the first ``n`` TinyStories stories."""
    out = []
    with open(TINYSTORIES) as f:
        for line in f:
            out.append(" ".join(json.loads(line)["text"].split()[:words]))
            if len(out) == n:
                break
    return out


def draft_cases(batches, num_prompts: int, max_tokens: int, k: int, repeats: int = 1) -> None:
    """stories260K with its early-exit drafts (first two, first four layers) and with itself as draft."""
    prompts = openings(num_prompts, 40)
    with tempfile.TemporaryDirectory() as tmp:
        drafts = [(f"early-exit draft ({n} of 5 layers)", write_early_exit_draft(STORIES, os.path.join(tmp, f"early_exit_{n}"), n)) for n in (2, 4)]
        for name, draft in drafts + [("itself as draft", STORIES)]:
            spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
            case(f"stories260K, {name}", STORIES, prompts, batches, max_tokens, spec, "float32", repeats=repeats)


def run(model: str, prompts: list, batch: int, max_tokens: int, spec: dict | None, dtype: str) -> dict:
    llm = LLM(model, dtype=dtype, max_num_seqs=batch, num_kv_blocks=max(64, batch * 64), max_model_len=512,
              speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:batch], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    s = llm.get_stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return dict(tok_s=tokens / elapsed, ids=[o.outputs[0].token_ids for o in outs], proposed=s.num_draft_tokens,
                accepted=s.num_accepted_tokens, by_position=s.acceptance_rate_per_position)


SPEC_FUNCTIONS = [  # (label, path suffix, function): the speculative path's own host work, cumulative
    ("propose + lookahead slots (Speculator.plan)", "pagedgen/spec_decode/speculator.py", "plan"),
    ("  n-gram lookup", "pagedgen/spec_decode/ngram.py", "propose"),
    ("  lookahead slots (Scheduler.add_lookahead)", "pagedgen/core/scheduler.py", "add_lookahead"),
    ("verify rows (verify.draft_rows)", "pagedgen/spec_decode/verify.py", "draft_rows"),
    ("accept (verify.collapse)", "pagedgen/spec_decode/verify.py", "collapse"),
    ("commit + rollback (Speculator.commit)", "pagedgen/spec_decode/speculator.py", "commit"),
    ("  rollback (Scheduler.rollback)", "pagedgen/core/scheduler.py", "rollback"),
]


def profile(model: str, prompts: list, batch: int, max_tokens: int, spec: dict | None, dtype: str) -> None:
    """Where the time of one generate call goes (benchmarks/_profile.py: cProfile on the thread's CPU
    time, torch on one thread), off or on: its components, the speculative path's functions and the
    top functions by own time."""
    import cProfile
    import pstats

    import torch
    from _profile import _function_times, _lm_head_line, breakdown

    llm = LLM(model, dtype=dtype, max_num_seqs=batch, num_kv_blocks=max(64, batch * 64), max_model_len=512,
              speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:batch], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        prof = cProfile.Profile(time.thread_time)
        start = time.thread_time()
        prof.runcall(llm.generate, prompts, params, use_tqdm=False)
        total = time.thread_time() - start
    finally:
        torch.set_num_threads(threads)
    stats = pstats.Stats(prof)
    steps = llm.get_stats().num_steps
    print(f"  spec {'on' if spec else 'off'}: {total:.3f} CPU s, {steps} steps ({steps and total / steps * 1e6:,.0f} us a step)")
    for r in breakdown(stats, total, _lm_head_line()):
        print(f"    {r['component']:<56}{r['seconds']:>8.3f}{r['share']:>8.1%}")
    times = _function_times(stats)
    for label, suffix, name in SPEC_FUNCTIONS if spec else []:
        sec = sum(ct for (path, func, _), (ct, _, _, _) in times.items() if path.endswith(suffix) and func == name)
        print(f"    {label:<56}{sec:>8.3f}{sec / total:>8.1%}")
    print("    top functions by own time:")
    for (path, func, line), (ct, tt, nc, _) in sorted(times.items(), key=lambda kv: -kv[1][1])[:14]:
        print(f"      {tt:8.3f} {tt / total:6.1%} {nc:>9,}  {os.path.basename(path)}:{line}({func})")


def matmul_peak(dtype: str, size: int = 2048, calls: int = 9) -> float:
    """GFLOP/s of torch.mm on [size, size] x [size, size] in ``dtype`` with the engine's threads:
    the median of ``calls`` calls (the matmul peak the GEMMs are compared with)."""
    import torch

    a = torch.randn(size, size, dtype=getattr(torch, dtype))
    b = torch.randn(size, size, dtype=getattr(torch, dtype))
    torch.mm(a, b)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - start)
    return 2 * size**3 / sorted(times)[calls // 2] / 1e9


def timed_run(model: str, prompts: list, batch: int, max_tokens: int, spec: dict | None, dtype: str) -> dict:
    """``run`` with every matmul (``pagedgen.layers.matmul.linear``, through the modules that call
    it) and every ``ops.paged_attention`` call timed: seconds and GEMM FLOPs (2 M N K a call)."""
    import pagedgen.layers.embedding as embedding
    import pagedgen.layers.linear as linear_layers
    from pagedgen import ops

    acc = {"gemm_s": 0.0, "gemm_flop": 0.0, "attn_s": 0.0}

    def timed_linear(real):
        def call(x, weight, *args, **kwargs):
            start = time.perf_counter()
            y = real(x, weight, *args, **kwargs)
            acc["gemm_s"] += time.perf_counter() - start
            acc["gemm_flop"] += 2.0 * x.shape[0] * x.shape[1] * y.shape[-1]
            return y
        return call

    def timed_attention(real):
        def call(*args, **kwargs):
            start = time.perf_counter()
            real(*args, **kwargs)
            acc["attn_s"] += time.perf_counter() - start
        return call

    saved = (linear_layers.linear, embedding.linear, ops.paged_attention)
    linear_layers.linear, embedding.linear = timed_linear(saved[0]), timed_linear(saved[1])
    ops.paged_attention = timed_attention(saved[2])
    try:
        llm = LLM(model, dtype=dtype, max_num_seqs=batch, num_kv_blocks=max(64, batch * 64), max_model_len=512,
                  speculative_config=spec)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate(prompts[:batch], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
        for key in acc:
            acc[key] = 0.0
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        acc["total_s"] = time.perf_counter() - start
        acc["steps"] = llm.get_stats().num_steps
    finally:
        linear_layers.linear, embedding.linear, ops.paged_attention = saved
    return acc


def bound(name: str, model: str, prompts: list, batches, max_tokens: int, spec: dict, dtype: str) -> None:
    """Why a speed-up stops where it does: for speculation off and on, the time in the GEMMs, their
    GFLOP/s against the matmul peak measured in the same run (torch.mm 2048 x 2048 before and after),
    attention, the rest; and the ceiling of on / off were the on run's GEMMs at that peak (the rest
    as measured). Verification computes a row per kept token or more, so the GEMM FLOPs on are those
    off or more: where the off run's GEMMs already run near the peak, speculation cannot gain more
    than the peak over their rate."""
    for batch in batches:
        peak0 = matmul_peak(dtype)
        runs = {label: timed_run(model, prompts, batch, max_tokens, s, dtype) for label, s in (("off", None), ("on", spec))}
        peak = max(peak0, matmul_peak(dtype))
        print(f"{name} batch {batch}, bound: matmul peak {peak:,.0f} GFLOP/s (torch.mm 2048^3 {dtype}, before {peak0:,.0f})")
        for label, r in runs.items():
            rate = r["gemm_flop"] / r["gemm_s"] / 1e9
            rest = r["total_s"] - r["gemm_s"] - r["attn_s"]
            print(f"  {label}: {r['total_s']:.3f} s, {r['steps']} steps; GEMMs {r['gemm_s']:.3f} s ({r['gemm_s'] / r['total_s']:.0%}), "
                  f"{r['gemm_flop'] / 1e9:,.1f} GFLOP at {rate:,.0f} GFLOP/s ({rate / peak:.0%} of the peak); "
                  f"attention {r['attn_s']:.3f} s ({r['attn_s'] / r['total_s']:.0%}); the rest {rest:.3f} s", flush=True)
        off, on = runs["off"], runs["on"]
        at_peak = on["total_s"] - on["gemm_s"] + on["gemm_flop"] / peak / 1e9
        print(f"  on / off {off['total_s'] / on['total_s']:.2f}x; with the on run's GEMMs at the peak: at most "
              f"{off['total_s'] / at_peak:.2f}x; with its GEMMs at the peak and nothing else: {off['total_s'] / (on['gemm_flop'] / peak / 1e9):.2f}x",
              flush=True)


def case(name: str, model: str, prompts: list, batches, max_tokens: int, spec: dict, dtype: str, profiled: bool = False,
         repeats: int = 1) -> None:
    if BOUND:
        bound(name, model, prompts, batches, max_tokens, spec, dtype)
        return
    for batch in batches:
        if profiled:
            print(f"{name} batch {batch}, profiled:", flush=True)
            profile(model, prompts, batch, max_tokens, None, dtype)
            profile(model, prompts, batch, max_tokens, spec, dtype)
            continue
        offs, ons = [], []
        for r in range(repeats):  # interleaved, the order swapped every repeat, so drift hits both alike
            pair = [("off", None), ("on", spec)] if r % 2 == 0 else [("on", spec), ("off", None)]
            for label, s in pair:
                (offs if label == "off" else ons).append(run(model, prompts, batch, max_tokens, s, dtype))
        off = sorted(offs, key=lambda x: x["tok_s"])[len(offs) // 2]
        on = sorted(ons, key=lambda x: x["tok_s"])[len(ons) // 2]
        same = "equal" if all(o["ids"] == offs[0]["ids"] for o in offs + ons) else "DIFFERENT"
        rate = on["accepted"] / on["proposed"] if on["proposed"] else 0.0
        each = ""
        if repeats > 1:
            each = " (repeats: " + ", ".join(f"{b['tok_s']:,.0f}/{a['tok_s']:,.0f} = {b['tok_s'] / a['tok_s']:.2f}x" for a, b in zip(offs, ons)) + ")"
        print(f"{name} batch {batch}: off {off['tok_s']:,.0f} tok/s, on {on['tok_s']:,.0f} tok/s, {on['tok_s'] / off['tok_s']:.2f}x{' (medians)' if repeats > 1 else ''}{each}; "
              f"accepted {on['accepted']:,}/{on['proposed']:,} ({rate:.1%}), by position {on['by_position']}; outputs {same}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a smoke run: stories260K only, small")
    ap.add_argument("--draft-model", action="store_true", help="only the draft-model cases")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--case", choices=("all", "random", "stories", "full"), default="all",
                    help="random-135m (lookup right), stories260K restart (lookup misses), batch 256; default all")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="batch sizes (default 1 4 8; 256 for full)")
    ap.add_argument("--num-prompts", type=int, default=None, help="prompts per run (default 16 random, 64 stories, 256 full)")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per prompt (default 128; 64 full)")
    ap.add_argument("--profile", action="store_true", help="profile each run (off and on) instead of timing it")
    ap.add_argument("--bound", action="store_true",
                    help="time the GEMMs and attention off and on against the matmul peak measured in the run (the ceiling of on / off)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of each side, interleaved (order swapped every repeat); medians and each pair reported")
    args = ap.parse_args()
    global BOUND
    BOUND = args.bound
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    if args.tiny:
        case("stories260K restart", STORIES, restart_prompts(8, 40), (1, 4), 32, spec, "float32", args.profile)
        draft_cases((1, 4), 8, 32, args.k)
        return
    if args.draft_model:
        draft_cases(tuple(args.batches) if args.batches else (1, 4, 8), args.num_prompts or 64, args.max_tokens or 128, args.k, args.repeats)
        return
    batches = tuple(args.batches) if args.batches else (1, 4, 8)
    max_tokens = args.max_tokens or 128
    if args.case in ("all", "random"):
        model, _ = ensure_random_model("random-135m", "bfloat16")
        from transformers import AutoTokenizer

        # its GPT-2 tokenizer holds ids past the model's 49,152: those are folded in (_workload.fold_ids)
        texts = restart_prompts(args.num_prompts or 16, 60)
        ids, _ = fold_ids(AutoTokenizer.from_pretrained(gpt2_tokenizer_dir())(texts)["input_ids"], RANDOM_MODELS["random-135m"]["vocab_size"])
        case("random-135m bf16", model, ids, batches, max_tokens, spec, "bfloat16", args.profile, args.repeats)
    if args.case in ("all", "stories"):
        case("stories260K restart", STORIES, restart_prompts(args.num_prompts or 64, 60), batches, max_tokens, spec, "float32", args.profile, args.repeats)
    if args.case in ("all", "full"):
        case("stories260K batch 256, disable_by_batch_size 64", STORIES, restart_prompts(args.num_prompts or 256, 60),
             tuple(args.batches) if args.batches else (256,), args.max_tokens or 64, dict(spec, disable_by_batch_size=64), "float32", args.profile, args.repeats)
    if args.case == "all":
        draft_cases(batches, 64, max_tokens, args.k, args.repeats)


if __name__ == "__main__":
    main()
