"""Offline throughput: pagedgen vs transformers static batching vs transformers continuous batching.

Every system gets the same model, the same prompt token ids and the same per-request max_tokens
(drawn once, seeded), greedy decoding, EOS ignored. Output tokens/s = useful output tokens / wall
seconds of the generation call(s); model loading, KV cache allocation and warm-up are not timed.
Each timed run of pagedgen and generate_batch starts from an empty KV cache (no prefix cache hits
carried over from a warm-up or an earlier run).

    python benchmarks/throughput.py                                    # stories260K, 1,000 prompts, all systems
    python benchmarks/throughput.py --num-prompts 64 --static-batch-sizes 32 --dry-run
    python benchmarks/throughput.py --model random-135m --num-prompts 256 --out results/
    python benchmarks/throughput.py --workload sharegpt --systems pagedgen,generate_batch
    python benchmarks/throughput.py --model random-1b --device cuda --repeats 3 --out gpu_results/

Systems:
  pagedgen        LLM.generate over all prompts, one SamplingParams(temperature=0, max_tokens=m,
                  ignore_eos=True) per request.
  static          transformers model.generate on left-padded batches in prompt order, max_new_tokens =
                  the batch's largest max_tokens; best of --static-batch-sizes. Only each request's own
                  first max_tokens output tokens count as useful; the rest is wasted work, like padding.
  generate_batch  transformers continuous batching (the manager under model.generate_batch). generate_batch
                  itself takes one max_new_tokens for all requests, so requests are added one by one with
                  their own max_new_tokens (ContinuousBatchingManager.add_request), on a KV cache of the same
                  size and block (page) size as pagedgen's.
"""
from __future__ import annotations

import argparse
import csv
import gc
import inspect
import json
import os
import random
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(ROOT), "shared")
GPU_ASSETS = os.path.join(ROOT, ".gpu_assets")  # the GPU machine sees only the checkout
SYSTEMS = ("pagedgen", "static", "generate_batch")
BLOCK_SIZE = 16  # tokens per KV block, pagedgen's default; also the continuous batching page size
KV_MEMORY_FRACTION = 0.25  # KV cache cap as a share of available memory (pagedgen's default)

# Random-weight Llamas built here; vocab_size comes from the GPT-2 tokenizer they are saved with.
RANDOM_MODELS = {
    "random-135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                        intermediate_size=1536, tie_word_embeddings=True),  # SmolLM-135M shape
    "random-1b": dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                      intermediate_size=5632, tie_word_embeddings=False),  # TinyLlama-1.1B shape
}
RANDOM_MAX_LEN = 2048
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def asset(shared_rel: str, gpu_name: str) -> str:
    """``.gpu_assets/<gpu_name>`` inside the checkout when it exists, else ``../shared/<shared_rel>``."""
    local = os.path.join(GPU_ASSETS, gpu_name)
    return local if os.path.exists(local) else os.path.join(SHARED, shared_rel)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=asset("models/stories260K", "stories260K"),
                    help="checkpoint folder, or random-135m / random-1b (random weights, built here)")
    ap.add_argument("--dtype", default="auto", choices=["auto", *DTYPE_BYTES],
                    help="auto: the checkpoint's (bfloat16 for the random models)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--workload", default="tinystories", choices=["tinystories", "sharegpt"])
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--min-tokens", type=int, default=16, help="smallest per-request max_tokens")
    ap.add_argument("--max-tokens", type=int, default=256, help="largest per-request max_tokens")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    ap.add_argument("--static-batch-sizes", default="32,64,256")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per system; the median is reported")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="pagedgen; also continuous batching's requests per batch")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="pagedgen (default max(4096, max-num-seqs)); also continuous batching's max_batch_tokens")
    ap.add_argument("--num-kv-blocks", type=int, default=None,
                    help=f"KV cache of pagedgen and continuous batching, in blocks of {BLOCK_SIZE} tokens (default: enough "
                         f"for max-num-seqs of the longest request, capped at {KV_MEMORY_FRACTION * 100:.0f}%% of available memory)")
    ap.add_argument("--cb-attn", default="sdpa", choices=["sdpa", "paged|eager"],
                    help="attn_implementation for continuous batching (sdpa is the faster on CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="folder for throughput.json and throughput.txt")
    ap.add_argument("--dry-run", action="store_true", help="load prompts, print the plan, generate nothing")
    args = ap.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    args.static_batch_sizes = [int(b) for b in args.static_batch_sizes.split(",")]
    if not args.systems or not set(args.systems) <= set(SYSTEMS):
        ap.error(f"--systems must name some of {', '.join(SYSTEMS)}, got {args.systems}")
    if not 1 <= args.min_tokens <= args.max_tokens or min(args.num_prompts, args.repeats, args.max_num_seqs) < 1:
        ap.error("need 1 <= --min-tokens <= --max-tokens, and --num-prompts, --repeats, --max-num-seqs >= 1")
    return args


# ----- model and workload ---------------------------------------------------------------------------
def model_info(args) -> dict:
    """Tokenizer folder, dtype and shape facts of the model, without loading its weights."""
    if args.model in RANDOM_MODELS:
        cfg = dict(RANDOM_MODELS[args.model], max_position_embeddings=RANDOM_MAX_LEN)
        tokenizer, dtype = asset("models/gpt2-tokenizer", "gpt2-tokenizer"), "bfloat16"
    else:
        if not os.path.isfile(os.path.join(args.model, "config.json")):
            raise SystemExit(f"no config.json in {args.model}: give a checkpoint folder, random-135m or random-1b")
        with open(os.path.join(args.model, "config.json")) as f:
            cfg = json.load(f)
        tokenizer, dtype = args.model, cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    dtype = dtype if args.dtype == "auto" else args.dtype
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    kv_bytes_per_token = 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * DTYPE_BYTES.get(dtype, 4)  # K and V, all layers
    return dict(tokenizer=tokenizer, dtype=dtype, max_model_len=cfg["max_position_embeddings"],
                kv_bytes_per_token=kv_bytes_per_token)


def build_random_model(name: str, tokenizer_dir: str, dtype: str, folder: str) -> None:
    """Save a random-weight Llama of shape RANDOM_MODELS[name] and the tokenizer to ``folder``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(vocab_size=len(tok), max_position_embeddings=RANDOM_MAX_LEN, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                         **RANDOM_MODELS[name])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))  # built in dtype, no fp32 copy
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)


def load_workload(args, tokenizer, max_model_len: int) -> tuple[list[list[int]], list[int]]:
    """Prompt token ids and per-request max_tokens, both seeded by ``args.seed``."""
    rng = random.Random(args.seed)
    if args.workload == "tinystories":
        path = asset("data/tinystories_valid_first1000/tinystories_valid_first1000.jsonl", "tinystories_valid_first1000.jsonl")
        with open(path) as f:
            stories = [json.loads(line)["text"].split() for _, line in zip(range(args.num_prompts), f)]
        if len(stories) < args.num_prompts:
            raise SystemExit(f"{path} holds only {len(stories)} stories, {args.num_prompts} asked for")
        texts = [" ".join(words[: rng.randint(4, 24)]) for words in stories]  # first 4..24 words
        prompts = [list(ids) for ids in tokenizer(texts)["input_ids"]]
        max_tokens = [rng.randint(args.min_tokens, args.max_tokens) for _ in prompts]
    else:
        # (prefill, decode) token counts of ShareGPT conversations; output clipped to [min, max]-tokens,
        # prompt then cut so that prompt + output <= max_model_len; prompts are random non-special token ids.
        path = asset("data/sharegpt_lengths_sarathi/sharegpt_8k_filtered_stats_llama2_tokenizer.csv", "sharegpt_lengths.csv")
        with open(path) as f:
            rows = [(int(r["num_prefill_tokens"]), int(r["num_decode_tokens"])) for r in csv.DictReader(f)]
        special = set(tokenizer.all_special_ids)
        vocab = [t for t in range(len(tokenizer)) if t not in special]
        prompts, max_tokens = [], []
        for p, o in (rng.choice(rows) for _ in range(args.num_prompts)):
            o = min(max(o, args.min_tokens), args.max_tokens, max_model_len - 1)
            p = max(1, min(p, max_model_len - o))
            prompts.append([rng.choice(vocab) for _ in range(p)])
            max_tokens.append(o)
    return prompts, max_tokens


def default_kv_blocks(args, info: dict, longest: int) -> int:
    """Blocks for ``max_num_seqs`` requests of ``longest`` tokens, capped by a share of free memory."""
    import psutil

    want = args.max_num_seqs * -(-longest // BLOCK_SIZE)
    cap = int(psutil.virtual_memory().available * KV_MEMORY_FRACTION) // (info["kv_bytes_per_token"] * BLOCK_SIZE)
    return max(1, min(want, cap))


# ----- the three systems -----------------------------------------------------------------------------
def timed(fn, device: str):
    """(wall seconds, result) of ``fn()``, the device synchronised on both sides."""
    sync = __import__("torch").cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - start, out


def warmup_prompts(prompts: list[list[int]]) -> list[list[int]]:
    return [p[::-1] for p in prompts[:8]]  # reversed: no prefix in common with the timed prompts


def check_lengths(system: str, outputs: list[list[int]], max_tokens: list[int]) -> None:
    if [len(o) for o in outputs] != max_tokens:  # ignore_eos must hold in every system
        raise RuntimeError(f"{system}: some requests did not produce exactly max_tokens tokens")


def run_pagedgen(args, model_path, prompts, max_tokens, kv_blocks) -> dict:
    from pagedgen import LLM, SamplingParams, ops

    kwargs = dict(dtype=args.dtype, num_kv_blocks=kv_blocks, block_size=BLOCK_SIZE, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed)
    if args.device != "cpu":
        kwargs["device"] = args.device
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    seconds = []
    for _ in range(args.repeats):  # a fresh LLM per run: no prefix cache left over from the run before
        llm = LLM(model_path, **kwargs)
        llm.generate(warmup_prompts(prompts), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        before = llm.get_stats()
        t, outs = timed(lambda: llm.generate(prompts, params, use_tqdm=False), args.device)
        after = llm.get_stats()
        seconds.append(t)
        del llm
    outputs = [o.outputs[0].token_ids for o in outs]
    check_lengths("pagedgen", outputs, max_tokens)
    steps = after.num_steps - before.num_steps
    # kv_utilization_mean is a mean over steps: keep the timed run's share only
    util = (after.kv_utilization_mean * after.num_steps - before.kv_utilization_mean * before.num_steps) / max(steps, 1)
    ops_kind = "compiled pagedgen._C" if ops.extension_available(args.device) else "PyTorch reference ops (no pagedgen._C)"
    return dict(seconds=seconds, useful_tokens=sum(max_tokens), computed_tokens=sum(max_tokens), outputs=outputs,
                kv_utilization_mean=util, preemptions=after.num_preemptions - before.num_preemptions,
                steps_per_run=steps, kv_blocks=kv_blocks, ops=ops_kind)


def load_hf(model_path, args, attn: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=args.dtype, attn_implementation=attn).to(args.device).eval()


def run_static(args, model_path, tokenizer, prompts, max_tokens) -> dict:
    import torch

    model = load_hf(model_path, args, "sdpa")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.unk_token_id

    def generate(batch: list[list[int]], new_tokens: int) -> list[list[int]]:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=args.device)  # [B, width], left-padded
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=args.device)  # [B, width]
        # eos_token_id=None as a keyword turns EOS off; inside a GenerationConfig None means "unset", and
        # generate would take the model's generation_config.eos_token_id again.
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                             eos_token_id=None, pad_token_id=pad)  # [B, width + new_tokens]
        if out.shape[1] != width + new_tokens:
            raise RuntimeError(f"static: generate stopped after {out.shape[1] - width} of {new_tokens} tokens")
        return out[:, width:].tolist()

    per_size = {}
    with torch.no_grad():
        generate(warmup_prompts(prompts), 4)
        for bs in args.static_batch_sizes:
            batches = [(prompts[s: s + bs], max_tokens[s: s + bs]) for s in range(0, len(prompts), bs)]
            seconds = []
            for _ in range(args.repeats):
                runs = [timed(lambda: generate(b, max(m)), args.device) for b, m in batches]
                seconds.append(sum(t for t, _ in runs))
            # useful: each request's own first max_tokens; computed: all rows run to the batch's largest
            outputs = [row[:m] for (_, out), (_, ms) in zip(runs, batches) for row, m in zip(out, ms)]
            check_lengths("static", outputs, max_tokens)
            per_size[bs] = dict(seconds=seconds, useful_tokens=sum(max_tokens), outputs=outputs,
                                computed_tokens=sum(len(b) * max(m) for b, m in batches))
    best = min(per_size, key=lambda b: statistics.median(per_size[b]["seconds"]))
    return dict(per_size[best], batch_size=best, per_batch_size=per_size)


def run_generate_batch(args, model_path, prompts, max_tokens, kv_blocks) -> dict:
    import torch
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model = load_hf(model_path, args, args.cb_attn)
    # eos_token_id=-1 turns EOS off (None would be replaced by the model's EOS)
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max(max_tokens), eos_token_id=-1)
    # without num_blocks it sizes its cache from 90% of the machine's RAM on CPU
    cb_config = ContinuousBatchingConfig(page_size=BLOCK_SIZE, num_blocks=kv_blocks, max_requests_per_batch=args.max_num_seqs,
                                         max_batch_tokens=args.max_num_batched_tokens or max(4096, args.max_num_seqs))

    def collect(manager, tag: str, batch: list[list[int]], limits: list[int]) -> list[list[int]]:
        for i, (p, m) in enumerate(zip(batch, limits)):
            manager.add_request(p, request_id=f"{tag}-{i}", max_new_tokens=m, eos_token_id=-1)
        results = {}
        while len(results) < len(batch):
            r = manager.get_result(timeout=1)
            if r is None and not manager.is_running():
                raise RuntimeError("generate_batch: the generation thread stopped")
            if r is not None and r.is_finished():
                if r.error is not None:
                    raise RuntimeError(f"generate_batch: request {r.request_id} failed: {r.error}")
                results[r.request_id] = r.generated_tokens
        return [results[f"{tag}-{i}"] for i in range(len(batch))]

    runs = []
    for _ in range(args.repeats):  # a fresh manager (and KV cache) per run, as for pagedgen
        with torch.no_grad(), model.continuous_batching_context_manager(
            generation_config=gen_config, continuous_batching_config=cb_config, block=True, timeout=5
        ) as manager:
            collect(manager, "warmup", warmup_prompts(prompts), [4] * len(warmup_prompts(prompts)))
            runs.append(timed(lambda: collect(manager, "run", prompts, max_tokens), args.device))
    check_lengths("generate_batch", runs[-1][1], max_tokens)
    return dict(seconds=[t for t, _ in runs], useful_tokens=sum(max_tokens), computed_tokens=sum(max_tokens),
                outputs=runs[-1][1], attn_implementation=args.cb_attn, kv_blocks=kv_blocks)


# ----- report ---------------------------------------------------------------------------------------
def tok_per_s(result: dict) -> float:
    return result["useful_tokens"] / statistics.median(result["seconds"])


def report(args, results: dict, say) -> dict:
    say(f"\n{'system':<34}{'output tok/s':>14}{'seconds':>10}{'useful tok':>12}{'computed tok':>14}")
    rows = [("pagedgen", results["pagedgen"])] if "pagedgen" in results else []
    for bs, r in results.get("static", {}).get("per_batch_size", {}).items():
        rows.append((f"static, batch {bs}" + (" (best)" if bs == results["static"]["batch_size"] else ""), r))
    rows += [(f"generate_batch ({args.cb_attn})", results["generate_batch"])] if "generate_batch" in results else []
    for name, r in rows:
        say(f"{name:<34}{tok_per_s(r):>14,.0f}{statistics.median(r['seconds']):>10.2f}{r['useful_tokens']:>12,}{r['computed_tokens']:>14,}")
    say("useful tok: each request's own first max_tokens output tokens. static batching runs every request of a batch")
    say("to the batch's largest max_tokens (computed tok); the tokens beyond a request's own limit are wasted, like padding.")
    summary = {name: tok_per_s(r) for name, r in results.items()}
    summary.update({f"static_batch_{bs}": tok_per_s(r) for bs, r in results.get("static", {}).get("per_batch_size", {}).items()})
    if "pagedgen" in results:
        p = results["pagedgen"]
        say(f"pagedgen: {p['ops']}; KV cache {p['kv_blocks']} blocks of {BLOCK_SIZE}, utilisation mean "
            f"{p['kv_utilization_mean']:.1%}, preemptions {p['preemptions']}, {p['steps_per_run']} steps per run")
        for other, target in (("static", 5.0), ("generate_batch", 1.0)):
            if other in results:
                ratio = summary["pagedgen"] / summary[other]
                summary[f"pagedgen/{other}"] = ratio
                say(f"pagedgen / {other + (' best' if other == 'static' else ''):<20} {ratio:6.2f}x   "
                    f"(target >= {target:g}x: {'met' if ratio >= target else 'NOT met'})")
    names = [n for n in SYSTEMS if n in results]
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            same = sum(x == y for x, y in zip(results[a]["outputs"], results[b]["outputs"])) / len(results[a]["outputs"])
            say(f"identical greedy outputs, {a} vs {b}: {same:.1%} of requests")
    say(f"median of {args.repeats} runs per system" if args.repeats > 1 else "one run per system")
    return summary


def main(argv=None) -> None:
    args = parse_args(argv)
    lines: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    llm_params = inspect.signature(__import__("pagedgen").LLM).parameters if "pagedgen" in args.systems else {}
    if args.device != "cpu" and "pagedgen" in args.systems and "device" not in llm_params:
        raise SystemExit(f"pagedgen's LLM does not accept device= yet: cannot run pagedgen on {args.device}")
    info = model_info(args)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(info["tokenizer"])
    prompts, max_tokens = load_workload(args, tokenizer, info["max_model_len"])
    longest = max(len(p) + m for p, m in zip(prompts, max_tokens))
    kv_blocks = args.num_kv_blocks or default_kv_blocks(args, info, longest)
    plens = [len(p) for p in prompts]
    import torch
    import transformers

    say(f"model {args.model} ({info['dtype']}, max_model_len {info['max_model_len']}) on {args.device}; "
        f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads, "
        f"{os.cpu_count()} CPUs")
    say(f"workload {args.workload}: {len(prompts)} requests, seed {args.seed}, greedy, ignore_eos")
    say(f"  prompt tokens min/mean/max {min(plens)}/{statistics.mean(plens):.1f}/{max(plens)}, total {sum(plens):,}")
    say(f"  max_tokens    min/mean/max {min(max_tokens)}/{statistics.mean(max_tokens):.1f}/{max(max_tokens)}, "
        f"total {sum(max_tokens):,} (the useful output tokens)")
    say(f"systems {','.join(args.systems)}; static batch sizes {args.static_batch_sizes}; generate_batch attn {args.cb_attn}; "
        f"max_num_seqs {args.max_num_seqs}, KV cache {kv_blocks} blocks of {BLOCK_SIZE} tokens; repeats {args.repeats}")
    if args.dry_run:
        say("dry run: nothing generated")
        return

    with tempfile.TemporaryDirectory(prefix="pagedgen-bench-") as tmp:
        model_path = args.model
        if args.model in RANDOM_MODELS:
            start = time.perf_counter()
            build_random_model(args.model, info["tokenizer"], info["dtype"], tmp)
            model_path = tmp
            say(f"built {args.model} (random weights) in {time.perf_counter() - start:.1f} s")
        runners = dict(pagedgen=lambda: run_pagedgen(args, model_path, prompts, max_tokens, kv_blocks),
                       static=lambda: run_static(args, model_path, tokenizer, prompts, max_tokens),
                       generate_batch=lambda: run_generate_batch(args, model_path, prompts, max_tokens, kv_blocks))
        results = {}
        for system in (s for s in SYSTEMS if s in args.systems):
            say(f"running {system} ...")
            results[system] = runners[system]()
            gc.collect()  # the model of one system is gone before the next loads
    summary = report(args, results, say)

    if args.out:
        os.makedirs(args.out, exist_ok=True)
        public = {n: {k: v for k, v in r.items() if k not in ("outputs", "per_batch_size")} for n, r in results.items()}
        data = dict(command=sys.argv, args=vars(args), tokens_per_s=summary, results=public)
        with open(os.path.join(args.out, "throughput.json"), "w") as f:
            json.dump(data, f, indent=2)
        with open(os.path.join(args.out, "throughput.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
        print(f"wrote {args.out}/throughput.json and throughput.txt")


if __name__ == "__main__":
    main()
