"""Cost of per-step recording (``LLM.start_recording``): throughput with recording on vs off.

    python benchmarks/step_log.py                     # 1,000 TinyStories openings, 5 runs of each
    python benchmarks/step_log.py --quick             # smoke run: 64 prompts, 2 runs of each
    python benchmarks/step_log.py --out /tmp/steplog  # also step_log.json

Target (issue 16): on costs under 2% of output tokens/s; off costs nothing (one ``is None`` test
per step). Both settings run on one LLM, alternating run by run (off, on, off, on, ...), so that
both see the same machine load; the medians are compared. Two workloads: the throughput
benchmark's (stories260K, max_num_seqs 256: long steps) and the same prompts with max_num_seqs 8
(short steps, where a fixed per-step cost weighs most). Greedy, ignore_eos, per-request max_tokens
drawn once (seed 0) from 16-256. Also measured in the same process: the time of one ``record``
call and of the ``is None`` test the engine makes when recording is off, against the mean step.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import timeit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.environ.get("PAGEDGEN_SHARED", os.path.join(os.path.dirname(ROOT), "shared"))
STORIES = os.path.join(SHARED, "models", "stories260K")
TINYSTORIES = os.path.join(SHARED, "data", "tinystories_valid_first1000", "tinystories_valid_first1000.jsonl")
TARGET = 0.02  # recording may cost at most this share of throughput


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=STORIES, help="checkpoint folder")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=256, help="largest per-request max_tokens (the smallest is 16)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs of each setting per workload")
    ap.add_argument("--max-num-seqs", default="256,8", help="comma-separated: one workload per value")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--quick", action="store_true", help="64 prompts, 2 runs of each: a smoke run")
    ap.add_argument("--timeit-calls", type=int, default=200_000, help="calls timed for the per-call costs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="folder for step_log.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.num_prompts, args.repeats = min(args.num_prompts, 64), min(args.repeats, 2)
    args.max_num_seqs = [int(x) for x in args.max_num_seqs.split(",") if x.strip()]
    if args.max_tokens < 16:
        ap.error("--max-tokens must be >= 16")
    if min(args.num_prompts, args.repeats, args.timeit_calls) < 1 or not args.max_num_seqs or min(args.max_num_seqs) < 1 or args.threads < 0:
        ap.error("--num-prompts, --repeats, --timeit-calls and every --max-num-seqs must be >= 1, --threads >= 0")
    return args


def workload(num_prompts: int, max_tokens: int, seed: int) -> tuple[list[str], list[int]]:
    """TinyStories openings (first 3-40 words) and per-request max_tokens in 16..max_tokens."""
    rng = random.Random(seed)
    with open(TINYSTORIES) as f:
        stories = [json.loads(line)["text"].split() for _, line in zip(range(num_prompts), f)]
    if len(stories) < num_prompts:
        raise SystemExit(f"{TINYSTORIES} holds only {len(stories)} stories, {num_prompts} asked for")
    return [" ".join(w[: rng.randint(3, 40)]) for w in stories], [rng.randint(16, max_tokens) for _ in stories]


def measure(args, max_num_seqs: int, prompts: list[str], max_tokens: list[int]) -> dict:
    from pagedgen import LLM, SamplingParams

    llm = LLM(args.model, max_num_seqs=max_num_seqs, seed=args.seed)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    useful = sum(max_tokens)
    llm.generate(prompts[:8], params[:8], use_tqdm=False)  # warm-up
    runs: dict[str, list[float]] = {"off": [], "on": []}
    outputs, steps = {}, 0
    for _ in range(args.repeats):
        for setting in ("off", "on"):
            log = llm.start_recording() if setting == "on" else None
            start = time.perf_counter()
            out = llm.generate(prompts, params, use_tqdm=False)
            runs[setting].append(useful / (time.perf_counter() - start))
            if log is not None:
                llm.stop_recording()
                steps = len(log)
            outputs[setting] = [o.outputs[0].token_ids for o in out]
    # one record call and the "off" test, timed in place on this engine
    engine = llm.llm_engine
    log = llm.start_recording()
    n = args.timeit_calls
    record_s = timeit.timeit(lambda: log.record(0, 0), number=n) / n
    llm.stop_recording()
    off_s = timeit.timeit("engine.step_log is not None", globals={"engine": engine}, number=n) / n
    on, off = statistics.median(runs["on"]), statistics.median(runs["off"])
    step_s = useful / off / steps
    return dict(max_num_seqs=max_num_seqs, num_prompts=len(prompts), output_tokens=useful, steps_per_run=steps,
                tok_s_off=off, tok_s_on=on, cost=1 - on / off, runs_off=runs["off"], runs_on=runs["on"],
                mean_step_s=step_s, record_call_s=record_s, off_check_s=off_s,
                record_share_of_step=record_s / step_s, off_share_of_step=off_s / step_s,
                identical_outputs=outputs["on"] == outputs["off"])


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    prompts, max_tokens = workload(args.num_prompts, args.max_tokens, args.seed)
    print(f"model {args.model}; {len(prompts)} prompts, {sum(max_tokens):,} output tokens, greedy, ignore_eos; "
          f"{args.repeats} runs of each setting, alternating; torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{os.cpu_count()} CPUs", flush=True)
    results = []
    for max_num_seqs in args.max_num_seqs:
        r = measure(args, max_num_seqs, prompts, max_tokens)
        results.append(r)
        print(f"max_num_seqs {max_num_seqs:>4}: {r['steps_per_run']} steps of {1e3 * r['mean_step_s']:.2f} ms; output tok/s "
              f"off {r['tok_s_off']:,.0f}, on {r['tok_s_on']:,.0f} (medians): recording costs {r['cost']:+.2%} "
              f"(target < {TARGET:.0%}: {'met' if r['cost'] < TARGET else 'NOT met'}); one record {1e6 * r['record_call_s']:.2f} us "
              f"= {r['record_share_of_step']:.3%} of a step; off: {1e9 * r['off_check_s']:.0f} ns "
              f"= {r['off_share_of_step']:.4%} of a step; outputs identical: {r['identical_outputs']}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "step_log.json"), "w") as f:
            json.dump(dict(command=sys.argv, args=vars(args), results=results), f, indent=2)
        print(f"wrote {args.out}/step_log.json")
    return dict(results=results)


if __name__ == "__main__":
    main()
