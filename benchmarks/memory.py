"""KV-cache memory: utilisation, savings from sharing, and prefix-caching throughput (paper section 6).

    python benchmarks/memory.py                                  # all sections, default sizes
    python benchmarks/memory.py --sections util --num-requests 500
    python benchmarks/memory.py --sections prefix --prefix-model random-135m --num-requests 32 --repeats 1
    python benchmarks/memory.py --quick                          # smoke run (< 1 minute on 2 cores)
    python benchmarks/memory.py --threads 1                      # on a busy shared machine

Sections, each printed beside the PagedAttention paper's figures (OPT-13B on A100):
  util     KV utilisation on ShareGPT lengths (prompt/output token counts of the sarathi CSV, requests
           with prompt + output <= --max-model-len, seeded sample, random prompt token ids, greedy,
           ignore_eos). pagedgen: EngineStats.kv_utilization_mean (real token slots / slots of used
           blocks, mean over steps). Contiguous reservation over the *same* schedule, sampled right
           after each step is scheduled: real tokens of the running sequences / their reserved slots,
           reserving max_model_len per sequence (Orca "Max"), the next power of two of prompt +
           max_tokens ("Pow2") or exactly prompt + max_tokens ("Oracle").
  sharing  EngineStats.sharing_savings_mean (1 - physical blocks / blocks the unshared block tables
           would need, mean over steps) for parallel sampling (n = 2, 4, 6; temperature 1, seeded) and
           beam search (width 2, 4, 6) on ShareGPT lengths and on an Alpaca-like short workload
           (TinyStories openings of 20-60 tokens, 60-200 output tokens, the real stories260K model).
           LLM.beam_search takes one max_tokens for all prompts, so beam-search requests are run in
           4 calls, grouped by output length, each with its group's mean output length.
  prefix   Output tokens/s with a shared 80-token (paper: 1-shot) or 341-token (5-shot) prefix, prefix
           caching on vs off, same requests: TinyStories prefix + each request's own 10-30-token
           suffix, 32-64 output tokens, greedy, ignore_eos, stories260K (or, --prefix-model random-135m,
           random weights of SmolLM-135M's shape in bf16, where prefill costs more than per-step
           overhead, as on the paper's GPU). Each timed run is a fresh LLM (empty prefix cache) after an
           untimed warm-up; the median over --repeats is reported.

The util and ShareGPT sharing runs use a random-weight Llama (hidden 64, 2 layers, 4 heads, 2 KV heads,
stories260K's 512-token vocabulary) with max_model_len 2048, OPT's context as in the paper, so the real
engine runs on CPU. Prefix caching is off in util and sharing (random prompts share no prefix; only
the fork mechanism is measured). Memory figures count blocks, not time, so the model does not change them
(beam search's do depend on how peaked its next-token distributions are).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import random
import statistics
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(ROOT), "shared")
STORIES = os.path.join(SHARED, "models", "stories260K")
TINYSTORIES = os.path.join(SHARED, "data", "tinystories_valid_first1000", "tinystories_valid_first1000.jsonl")
SHAREGPT = os.path.join(SHARED, "data", "sharegpt_lengths_sarathi", "sharegpt_8k_filtered_stats_llama2_tokenizer.csv")
SECTIONS = ("util", "sharing", "prefix")
BLOCK_SIZE = 16  # tokens per KV block
VOCAB = 512  # stories260K's tokenizer, which the random-weight models use too
STORIES_LEN = 512  # stories260K's context (max_position_embeddings), tokens
WIDTHS = (2, 4, 6)  # parallel-sampling n and beam widths, as in the paper's figures 15-16
PREFIX_LENS = (80, 341)  # tokens of the paper's 1-shot and 5-shot prefixes
TINY = dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
SMOL = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3)  # SmolLM-135M
UTIL_POOL_SEQS = 32  # util: the KV pool holds this many max_model_len sequences (pagedgen packs more)

# The paper's figures (PagedAttention, SOSP 2023, figures 2 and 15-16), as fractions or ratios.
PAPER = {
    "util": {"existing systems": (0.204, 0.382), "vLLM": (0.963, 0.963)},
    "parallel": {"alpaca": (0.061, 0.098), "sharegpt": (0.162, 0.305)},  # n = 2 .. 6
    "beam": {"alpaca": (0.376, 0.552), "sharegpt": (0.443, 0.663)},  # width 2 .. 6
    "prefix": {80: 1.67, 341: 3.58},  # throughput, shared prefix vs none
}
UTIL_TARGET = 0.97


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--num-requests", type=int, default=None,
                    help="requests per run in every section (default: util 300, sharing 48 ShareGPT / 64 Alpaca-like, prefix 256)")
    ap.add_argument("--max-model-len", type=int, default=2048, help="context of the random model (util, ShareGPT sharing)")
    ap.add_argument("--prefix-model", default="stories260K", choices=["stories260K", "random-135m"],
                    help="prefix: the real stories260K, or random weights of SmolLM-135M's shape (bf16; costly prefill, slow on CPU)")
    ap.add_argument("--repeats", type=int, default=5, help="prefix: timed runs per setting; the median is reported")
    ap.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch intra-op threads (0: torch's default); 1 avoids OpenMP stalls on a busy shared machine")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="folder for memory.json and memory.txt")
    args = ap.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    if not args.sections or not set(args.sections) <= set(SECTIONS):
        ap.error(f"--sections must name some of {', '.join(SECTIONS)}, got {args.sections}")
    if args.quick:
        args.max_model_len, args.repeats = min(args.max_model_len, STORIES_LEN), 1
    if min(args.num_requests or 1, args.repeats) < 1 or args.threads < 0 or args.max_model_len < 2 * BLOCK_SIZE:
        ap.error("--num-requests and --repeats must be >= 1, --threads >= 0, --max-model-len >= 32")
    return args


def sizes(args) -> dict:
    """Requests per run of each workload (``--num-requests`` overrides them all)."""
    base = dict(util=16, sharegpt=4, alpaca=6, prefix=8) if args.quick else dict(util=300, sharegpt=48, alpaca=64, prefix=256)
    return {k: args.num_requests or v for k, v in base.items()}


# ----- models and workloads ----------------------------------------------------------------------------
def build_random_model(folder: str, max_len: int, shape: dict, dtype: str = "float32") -> str:
    """A random-weight Llama of ``shape`` with stories260K's tokenizer and a ``max_len`` context,
    saved to ``folder`` (returned)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(STORIES, model_max_length=1 << 30)  # long texts: no length warning
    config = LlamaConfig(vocab_size=len(tok), max_position_embeddings=max_len, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, tie_word_embeddings=True, **shape)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(getattr(torch, dtype)).save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


def sharegpt_requests(n: int, max_len: int, vocab: int, rng: random.Random) -> list[tuple[list[int], int]]:
    """``n`` (prompt token ids, output tokens) with ShareGPT's lengths, prompt + output <= ``max_len``."""
    with open(SHAREGPT) as f:
        rows = [(int(r["num_prefill_tokens"]), int(r["num_decode_tokens"])) for r in csv.DictReader(f)]
    rows = [(p, o) for p, o in rows if p >= 1 and o >= 1 and p + o <= max_len]
    return [([rng.randrange(3, vocab) for _ in range(p)], o) for p, o in rng.sample(rows, n)]  # ids 0-2 are special


def story_tokens(tokenizer, count: int) -> list[list[int]]:
    """Token ids (no BOS) of the first ``count`` TinyStories stories."""
    with open(TINYSTORIES) as f:
        texts = [json.loads(line)["text"] for _, line in zip(range(count), f)]
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def alpaca_like_requests(n: int, tokenizer, rng: random.Random) -> list[tuple[list[int], int]]:
    """``n`` (BOS + 20-60 TinyStories tokens, 60-200 output tokens): Alpaca's short instructions."""
    stories = [s for s in story_tokens(tokenizer, 4 * n) if len(s) >= 60][:n]
    return [([tokenizer.bos_token_id] + s[: rng.randint(20, 60)], rng.randint(60, 200)) for s in stories]


# ----- 1. KV utilisation ----------------------------------------------------------------------------------
def watch_contiguous(llm, max_len: int) -> dict[str, list[float]]:
    """Record, at every step (right after scheduling, where the engine samples its own utilisation),
    what contiguous reservation would use for the running sequences. Wraps this instance's
    ``scheduler.schedule``; changes nothing it plans."""
    sched, bm, schedule = llm.engine.scheduler, llm.engine.block_manager, llm.engine.scheduler.schedule
    ratios: dict[str, list[float]] = {"max": [], "pow2": [], "oracle": []}

    def observed_schedule():
        out = schedule()
        running = sched.running
        if running:
            real = sum(bm.num_tokens(s.seq_id) for s in running)  # token slots holding real tokens
            final = [s.num_prompt_tokens + s.sampling_params.max_tokens for s in running]
            ratios["max"].append(real / (len(running) * max_len))
            ratios["pow2"].append(real / sum(min(max_len, 1 << (f - 1).bit_length()) for f in final))
            ratios["oracle"].append(real / sum(final))
        return out

    sched.schedule = observed_schedule
    return ratios


def run_util(args, model_dir: str) -> dict:
    from pagedgen import LLM, SamplingParams

    max_len, n = args.max_model_len, sizes(args)["util"]
    requests = sharegpt_requests(n, max_len, VOCAB, random.Random(args.seed))
    pool = UTIL_POOL_SEQS * max_len // BLOCK_SIZE  # blocks
    llm = LLM(model_dir, num_kv_blocks=pool, max_model_len=max_len, enable_prefix_caching=False, seed=args.seed)
    ratios = watch_contiguous(llm, max_len)
    start = time.perf_counter()
    llm.generate([p for p, _ in requests], [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in requests], use_tqdm=False)
    stats = llm.get_stats()
    return dict(num_requests=n, max_model_len=max_len, num_kv_blocks=pool, seconds=time.perf_counter() - start,
                mean_prompt_tokens=statistics.mean(len(p) for p, _ in requests), mean_output_tokens=statistics.mean(o for _, o in requests),
                num_steps=stats.num_steps, num_preemptions=stats.num_preemptions, pagedgen=stats.kv_utilization_mean,
                **{f"contiguous_{k}": statistics.mean(v) for k, v in ratios.items()})


# ----- 2. sharing -----------------------------------------------------------------------------------------
def savings(llm_factory, requests, mode: str, width: int, seed: int) -> dict:
    """Run ``requests`` with n = ``width`` samples or beams on a fresh LLM; its sharing figures."""
    from pagedgen import BeamSearchParams, SamplingParams

    llm = llm_factory()
    start = time.perf_counter()
    prompts = [p for p, _ in requests]
    if mode == "parallel":
        params = [SamplingParams(n=width, temperature=1.0, seed=seed + i, max_tokens=o, ignore_eos=True) for i, (_, o) in enumerate(requests)]
        llm.generate(prompts, params, use_tqdm=False)
    else:  # one max_tokens per beam_search call: 4 calls over requests grouped by output length
        ranked = sorted(requests, key=lambda r: r[1])
        for g in range(4):
            group = ranked[g * len(ranked) // 4 : (g + 1) * len(ranked) // 4]
            if group:
                max_tokens = round(statistics.mean(o for _, o in group))
                llm.beam_search([p for p, _ in group], BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    s = llm.get_stats()
    return dict(savings_mean=s.sharing_savings_mean, peak_savings=s.peak_sharing_savings, num_copy_on_write=s.num_copy_on_write,
                num_preemptions=s.num_preemptions, num_steps=s.num_steps, seconds=time.perf_counter() - start)


def run_sharing(args, model_dir: str) -> dict:
    from transformers import AutoTokenizer

    from pagedgen import LLM

    n = sizes(args)
    rng = random.Random(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(STORIES, model_max_length=1 << 30)  # long texts: no length warning
    workloads = {
        "sharegpt": (model_dir, args.max_model_len, sharegpt_requests(n["sharegpt"], args.max_model_len, VOCAB, rng)),
        "alpaca": (STORIES, STORIES_LEN, alpaca_like_requests(n["alpaca"], tokenizer, rng)),
    }
    result = {}
    for name, (model, max_len, requests) in workloads.items():
        # a pool that holds every sequence unshared (no preemption, which would undo sharing), ~1 block
        # of copy-on-write slack per sequence
        pool = sum(max(WIDTHS) * (-(-(len(p) + o) // BLOCK_SIZE) + 1) for p, o in requests)
        factory = lambda: LLM(model, num_kv_blocks=pool, max_model_len=max_len, max_num_seqs=max(256, max(WIDTHS) * len(requests)),
                              enable_prefix_caching=False, seed=args.seed)
        result[name] = dict(num_requests=len(requests), mean_prompt_tokens=statistics.mean(len(p) for p, _ in requests),
                            mean_output_tokens=statistics.mean(o for _, o in requests),
                            **{mode: {str(w): savings(factory, requests, mode, w, args.seed) for w in WIDTHS} for mode in ("parallel", "beam")})
    return result


# ----- 3. shared-prefix throughput --------------------------------------------------------------------------
def run_prefix(args, model_dir: str) -> dict:
    from transformers import AutoTokenizer

    from pagedgen import LLM, SamplingParams

    rng = random.Random(args.seed)
    n = sizes(args)["prefix"]
    tokenizer = AutoTokenizer.from_pretrained(STORIES, model_max_length=1 << 30)  # long texts: no length warning
    stories = story_tokens(tokenizer, 200 + n)
    shared = [tokenizer.bos_token_id] + [t for s in stories[:10] for t in s]  # examples: the first stories, in a row
    own = [s[: rng.randint(10, 30)] for s in stories[200:]]  # each request's suffix, from a later story
    max_tokens = [rng.randint(32, 64) for _ in own]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    pool = (n + 4) * -(-(max(PREFIX_LENS) + 30 + 64) // BLOCK_SIZE)  # blocks: every request at once, unshared
    result = {"model": args.prefix_model}
    for length in PREFIX_LENS:
        prompts = [shared[:length] + s for s in own]
        runs = {True: [], False: []}
        hit_rate = 0.0
        for _ in range(args.repeats):
            for caching in (True, False):  # alternate, so both see the same machine load
                llm = LLM(model_dir, num_kv_blocks=pool, enable_prefix_caching=caching, seed=args.seed)
                llm.generate([s[::-1] for s in own[:4]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                runs[caching].append(sum(max_tokens) / (time.perf_counter() - start))  # output tokens/s
                if caching:
                    s = llm.get_stats()  # warm-up included: its 4 lookups miss (a few % of the tokens)
                    hit_rate = s.prefix_cache_hit_rate
        on, off = statistics.median(runs[True]), statistics.median(runs[False])
        result[str(length)] = dict(num_requests=len(prompts), prompt_tokens_mean=statistics.mean(len(p) for p in prompts),
                                   output_tokens_mean=statistics.mean(max_tokens), tok_s_on=on, tok_s_off=off, ratio=on / off,
                                   prefix_cache_hit_rate=hit_rate, runs_on=runs[True], runs_off=runs[False])
    return result


# ----- report ------------------------------------------------------------------------------------------------
def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def span(lo_hi: tuple[float, float]) -> str:
    lo, hi = lo_hi
    return pct(lo) if lo == hi else f"{pct(lo)}-{pct(hi)}"


def report(results: dict) -> str:
    lines = []
    if "util" in results:
        u = results["util"]
        lines += [f"KV utilisation, ShareGPT lengths: {u['num_requests']} requests (mean prompt {u['mean_prompt_tokens']:.0f}, "
                  f"output {u['mean_output_tokens']:.0f} tokens), max_model_len {u['max_model_len']}, {u['num_kv_blocks']} blocks of "
                  f"{BLOCK_SIZE}, {u['num_steps']} steps, {u['num_preemptions']} preemptions",
                  f"  {'system':<34}{'ours':>8}   paper",
                  f"  {'pagedgen (paged blocks)':<34}{pct(u['pagedgen']):>8}   vLLM {span(PAPER['util']['vLLM'])} (target >= {pct(UTIL_TARGET)})",
                  f"  {'contiguous, reserve max_model_len':<34}{pct(u['contiguous_max']):>8}   existing systems {span(PAPER['util']['existing systems'])}",
                  f"  {'contiguous, reserve pow2(final)':<34}{pct(u['contiguous_pow2']):>8}",
                  f"  {'contiguous, reserve final (oracle)':<34}{pct(u['contiguous_oracle']):>8}", ""]
    if "sharing" in results:
        for name, w in results["sharing"].items():
            lines.append(f"Memory saved by sharing, {name}{'' if name == 'sharegpt' else '-like'}: {w['num_requests']} requests "
                         f"(mean prompt {w['mean_prompt_tokens']:.0f}, output {w['mean_output_tokens']:.0f} tokens)")
            lines.append(f"  {'mode':<18}{'width':>6}{'savings':>10}{'peak':>8}{'CoW':>8}   paper (widths 2-6)")
            for mode in ("parallel", "beam"):
                for width, r in w[mode].items():
                    lines.append(f"  {mode + (' sampling' if mode == 'parallel' else ' search'):<18}{width:>6}{pct(r['savings_mean']):>10}"
                                 f"{pct(r['peak_savings']):>8}{r['num_copy_on_write']:>8}   {span(PAPER[mode][name])}")
            lines.append("")
    if "prefix" in results:
        p = results["prefix"]
        lines.append(f"Shared prefix, prefix caching on vs off ({p['model']}), output tokens/s, median of {results['config']['repeats']} runs")
        lines.append(f"  {'prefix':<16}{'requests':>9}{'on':>9}{'off':>9}{'ratio':>8}{'hit rate':>10}   paper")
        for length, r in ((k, v) for k, v in p.items() if k != "model"):
            label = f"{length} tok ({'1' if int(length) == 80 else '5'}-shot)"
            lines.append(f"  {label:<16}{r['num_requests']:>9}{r['tok_s_on']:>9.0f}{r['tok_s_off']:>9.0f}{r['ratio']:>7.2f}x"
                         f"{pct(r['prefix_cache_hit_rate']):>10}   {PAPER['prefix'][int(length)]:.2f}x")
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    results: dict = {"config": {k: v for k, v in vars(args).items() if k != "out"}}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if {"util", "sharing"} & set(args.sections):
            build_random_model(tmp, args.max_model_len, TINY)
        if "util" in args.sections:
            results["util"] = run_util(args, tmp)
        if "sharing" in args.sections:
            results["sharing"] = run_sharing(args, tmp)
        if "prefix" in args.sections:
            model = STORIES if args.prefix_model == "stories260K" else build_random_model(os.path.join(tmp, "smol"), STORIES_LEN, SMOL, "bfloat16")
            results["prefix"] = run_prefix(args, model)
    results["seconds"] = time.perf_counter() - start  # wall time of all sections
    text = report(results) + f"\n\nwall time {results['seconds']:.0f} s"
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "memory.json"), "w") as f:
            json.dump(results, f, indent=2)
        with open(os.path.join(args.out, "memory.txt"), "w") as f:
            f.write(text + "\n")
    return results


if __name__ == "__main__":
    main()
