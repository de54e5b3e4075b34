"""The command line at data-set scale (issue 10): its throughput against ``LLM.generate`` on the same
rows, and its peak resident memory at 10k vs 1M one-token rows (flat: rows are streamed).

Throughput: the same JSONL file of N rows (TinyStories openings, cycled, each with an id field),
greedy, max_tokens M, EOS ignored, through (a) ``pagedgen --input rows.jsonl --output out.jsonl`` and
(b) a script doing what a user would: read the rows, ``LLM.generate(prompts)``, write one JSON
line per row. Each run is a fresh process, the two alternate (A B A B ...), and both report the
time from after the model is loaded to the last row written ("loop"), and the process's whole wall
time ("wall"); medians of --repeats. Peak RSS: the CLI on R1 and R2 rows (one output token each),
read from the child's rusage (ru_maxrss).

    python benchmarks/cli_scale.py                       # 10,000 rows x 16 tokens, RSS at 10k and 1M rows
    python benchmarks/cli_scale.py --quick               # a couple of minutes: 200 rows, RSS at 1k and 10k rows
    python benchmarks/cli_scale.py --model random-135m --rows 2000 --max-tokens 32 --out results/
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(ROOT), "shared")
STORIES = os.path.join(SHARED, "models", "stories260K")
TINYSTORIES = os.path.join(SHARED, "data", "tinystories_valid_first1000", "tinystories_valid_first1000.jsonl")

# run in a child process: read the rows, LLM.generate, write JSONL (what the CLI replaces)
GENERATE_SCRIPT = r"""
import json, sys, time
from pagedgen import LLM, SamplingParams
model, src, dst, max_tokens, max_num_seqs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
llm = LLM(model, max_num_seqs=max_num_seqs)
start = time.perf_counter()
rows = [json.loads(line) for line in open(src, encoding="utf-8")]
outs = llm.generate([r["prompt"] for r in rows], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
with open(dst, "w", encoding="utf-8") as f:
    for i, (r, o) in enumerate(zip(rows, outs)):
        c = o.outputs[0]
        f.write(json.dumps({"index": i, **r, "completions": [{"text": c.text, "token_ids": c.token_ids,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}, ensure_ascii=False) + "\n")
print(json.dumps({"loop_s": time.perf_counter() - start, "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}))
"""


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=STORIES, help="checkpoint folder, or random-135m / random-1b (random bf16 weights, built once and cached by benchmarks/_workload.py)")
    ap.add_argument("--rows", type=int, default=10_000, help="rows of the throughput comparison")
    ap.add_argument("--max-tokens", type=int, default=16, help="output tokens per row (EOS ignored)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each side; medians reported")
    ap.add_argument("--rss-rows", default="10000,1000000", help="row counts of the peak-RSS runs (one output token each)")
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the child processes (default: unset)")
    ap.add_argument("--quick", action="store_true", help="200 rows, 1 repeat, RSS at 1k and 10k rows: checks the script runs")
    ap.add_argument("--out", default=None, help="folder for cli_scale.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.rows, args.repeats, args.rss_rows = min(args.rows, 200), 1, "1000,10000"
    args.rss_rows = [int(x) for x in args.rss_rows.split(",") if x.strip()]
    if min([args.rows, args.max_tokens, args.repeats, args.max_num_seqs, *args.rss_rows]) < 1:
        ap.error("--rows, --max-tokens, --repeats, --max-num-seqs and --rss-rows must be >= 1")
    return args


def openings() -> list[str]:
    with open(TINYSTORIES, encoding="utf-8") as f:
        return [" ".join(json.loads(line)["text"].split()[:12]) for line in f]


def write_rows(path: str, n: int, texts: list[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            f.write(json.dumps({"id": i, "prompt": texts[i % len(texts)]}) + "\n")


def run_child(cmd: list[str], env: dict) -> tuple[float, int, str, str, float]:
    """(wall seconds, peak RSS in bytes, stdout, stderr, CPU seconds: user + system) of ``cmd``,
    its own rusage read with os.wait4; raises on a non-zero exit."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:5])} ... exited with {proc.returncode}:\n{stderr[-3000:]}")
    return wall, usage.ru_maxrss * 1024, stdout, stderr, usage.ru_utime + usage.ru_stime  # ru_maxrss: KiB on Linux


def cli_cmd(model: str, src: str, dst: str, max_tokens: int, max_num_seqs: int) -> list[str]:
    return [sys.executable, "-m", "pagedgen", "--model", model, "--input", src, "--output", dst, "--overwrite",
            "--temperature", "0", "--ignore-eos", "--max-tokens", str(max_tokens), "--max-num-seqs", str(max_num_seqs), "--no-tqdm"]


def cli_loop_seconds(stderr: str) -> float:
    """The CLI summary's "... tokens in X s" (from after the model load to the last row written)."""
    m = re.search(r"output tokens in ([\d.]+) s", stderr)
    if not m:
        raise RuntimeError(f"no summary in the CLI's stderr:\n{stderr[-2000:]}")
    return float(m.group(1))


def main(argv=None) -> dict:
    args = parse_args(argv)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    texts = openings()
    results: dict = {"rows": args.rows, "max_tokens": args.max_tokens, "repeats": args.repeats}
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model.startswith("random-"):
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            from _workload import ensure_random_model  # the harness's cached random checkpoints (bf16)

            model, _ = ensure_random_model(args.model, "bfloat16")
        src = os.path.join(tmp, "rows.jsonl")
        write_rows(src, args.rows, texts)
        sides = {"cli": [], "generate": []}
        for r in range(args.repeats):
            for side in ("cli", "generate"):
                dst = os.path.join(tmp, f"{side}.jsonl")
                if side == "cli":
                    wall, rss, _, err, cpu = run_child(cli_cmd(model, src, dst, args.max_tokens, args.max_num_seqs), env)
                    loop = cli_loop_seconds(err)
                else:
                    cmd = [sys.executable, "-c", GENERATE_SCRIPT, model, src, dst, str(args.max_tokens), str(args.max_num_seqs)]
                    wall, rss, out, _, cpu = run_child(cmd, env)
                    loop = json.loads(out.strip().splitlines()[-1])["loop_s"]
                sides[side].append({"wall_s": wall, "loop_s": loop, "peak_rss": rss, "cpu_s": cpu})
                print(f"  run {r + 1}/{args.repeats} {side:8s} loop {loop:7.2f} s  wall {wall:7.2f} s  CPU {cpu:7.2f} s  "
                      f"peak RSS {rss / 2**20:7.1f} MiB", flush=True)
        tokens = args.rows * args.max_tokens
        for side, runs in sides.items():
            results[side] = {k: statistics.median(run[k] for run in runs) for k in ("wall_s", "loop_s", "peak_rss", "cpu_s")}
            results[side]["output_tok_s"] = tokens / results[side]["loop_s"]
        results["cli_vs_generate_throughput"] = results["cli"]["output_tok_s"] / results["generate"]["output_tok_s"]
        rss_runs = {}
        for n in args.rss_rows:
            big = os.path.join(tmp, f"rss{n}.jsonl")
            write_rows(big, n, texts)
            wall, rss, _, err, _ = run_child(cli_cmd(model, big, os.path.join(tmp, "rss-out.jsonl"), 1, args.max_num_seqs), env)
            rss_runs[n] = {"peak_rss": rss, "wall_s": wall, "loop_s": cli_loop_seconds(err)}
            os.remove(big)
            print(f"  CLI on {n:,} one-token rows: peak RSS {rss / 2**20:.1f} MiB, loop {rss_runs[n]['loop_s']:.1f} s", flush=True)
        results["rss"] = rss_runs
    lo, hi = min(args.rss_rows), max(args.rss_rows)
    print()
    print(f"| {args.rows:,} rows x {args.max_tokens} tokens (medians of {args.repeats}) | loop s | wall s | process CPU s | output tok/s (loop) | peak RSS MiB |")
    print("|---|---|---|---|---|---|")
    for side, name in (("generate", "read rows + LLM.generate + write"), ("cli", "pagedgen CLI")):
        s = results[side]
        print(f"| {name} | {s['loop_s']:.2f} | {s['wall_s']:.2f} | {s['cpu_s']:.2f} | {s['output_tok_s']:,.0f} | {s['peak_rss'] / 2**20:.0f} |")
    print(f"\nCLI / LLM.generate throughput: {results['cli_vs_generate_throughput']:.3f}")
    print(f"CLI peak RSS: {rss_runs[lo]['peak_rss'] / 2**20:.0f} MiB at {lo:,} rows, {rss_runs[hi]['peak_rss'] / 2**20:.0f} MiB at "
          f"{hi:,} rows (x{rss_runs[hi]['peak_rss'] / rss_runs[lo]['peak_rss']:.2f})")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "cli_scale.json"), "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
