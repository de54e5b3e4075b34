"""The cost of batch invariance (issue 13): pagedgen with ``batch_invariant=True`` vs ``False``.

    python benchmarks/batch_invariance.py                                      # stories260K fp32 + random-135m bf16
    python benchmarks/batch_invariance.py --models stories260K --num-prompts 256 --rounds 5
    python benchmarks/batch_invariance.py --quick                              # smoke run, seconds

Both LLMs are built once in this process, on the same model, and run the throughput benchmark's
workload (benchmarks/_workload.py: TinyStories openings, per-request max_tokens, greedy, EOS
ignored) in alternation (on, off, on, off, ...), so that a shared machine's drift hits both alike.
Time is the CPU time of this process (``time.process_time``; with ``--threads 1`` torch computes on
the calling thread, and other processes' load does not count), median over ``--rounds``; the cost
is ``median(on) / median(off) - 1``. Both runs' token ids are compared (they must be equal in
fp32; bf16 may part after near-ties, since only the on-mode's rows are invariant). Also printed:
the matmul path each LLM took (``LLM.matmul_config``) and the weight bytes it keeps.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import _workload


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="stories260K:float32,random-135m:bfloat16",
                    help="comma-separated MODEL:DTYPE; MODEL a checkpoint folder, stories260K or a random model name")
    ap.add_argument("--num-prompts", type=int, default=None, help="default: the workload's (256); 32 for random models")
    ap.add_argument("--min-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=None, help="default 256 (64 for random models)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="8 prompts, 8-16 tokens, 1 round: checks that it runs")
    ap.add_argument("--out", default=None, help="folder for batch_invariance.json")
    return ap.parse_args(argv)


def model_path(name: str, dtype: str) -> str:
    if name == "stories260K":
        return os.path.join(_workload.SHARED, "models", "stories260K")
    if name in _workload.RANDOM_MODELS:
        return _workload.ensure_random_model(name, dtype)[0]
    return name


def weight_bytes(llm) -> int:
    return sum(p.numel() * p.element_size() for p in llm.model.parameters())


def measure(name: str, dtype: str, args) -> dict:
    from transformers import AutoTokenizer

    from pagedgen import LLM, SamplingParams

    random_model = name in _workload.RANDOM_MODELS
    path = model_path(name, dtype)
    num_prompts = 8 if args.quick else args.num_prompts or (32 if random_model else 256)
    max_tokens = 16 if args.quick else args.max_tokens or (64 if random_model else 256)
    min_tokens = min(8 if args.quick else args.min_tokens, max_tokens)
    tok = AutoTokenizer.from_pretrained(path)
    prompts, limits = _workload.load_workload("tinystories", tok, num_prompts=num_prompts, min_tokens=min_tokens,
                                              max_tokens=max_tokens, max_prompt_tokens=None, max_model_len=512, seed=0)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in limits]
    llms = {mode: LLM(path, dtype=dtype, max_num_seqs=args.max_num_seqs, max_model_len=512, batch_invariant=mode)
            for mode in (True, False)}
    warm = _workload.warmup_prompts(prompts)
    for llm in llms.values():
        llm.generate(warm, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    seconds = {True: [], False: []}
    tokens = {}
    for _ in range(1 if args.quick else args.rounds):
        for mode, llm in llms.items():
            start = time.process_time()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds[mode].append(time.process_time() - start)
            tokens[mode] = [list(o.outputs[0].token_ids) for o in outs]
    on, off = statistics.median(seconds[True]), statistics.median(seconds[False])
    same = sum(a == b for a, b in zip(tokens[True], tokens[False]))
    return dict(model=name, dtype=dtype, num_prompts=num_prompts, output_tokens=sum(limits),
                cpu_seconds_on=seconds[True], cpu_seconds_off=seconds[False], cost=on / off - 1,
                same_tokens=f"{same}/{len(prompts)}", matmul=llms[True].matmul_config.reason,
                weight_bytes=weight_bytes(llms[True]))


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    results = []
    for spec in args.models.split(","):
        name, _, dtype = spec.partition(":")
        r = measure(name, dtype or "float32", args)
        results.append(r)
        print(f"{r['model']} {r['dtype']} ({r['num_prompts']} prompts, {r['output_tokens']} output tokens, "
              f"{args.threads} thread(s)): CPU s on {statistics.median(r['cpu_seconds_on']):.2f}, "
              f"off {statistics.median(r['cpu_seconds_off']):.2f} -> cost {100 * r['cost']:+.1f}%; "
              f"same tokens {r['same_tokens']}; matmul: {r['matmul']}; weights {r['weight_bytes'] / 2**20:.1f} MiB", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "batch_invariance.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
