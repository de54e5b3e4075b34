"""Batch generation over a JSONL file with Ray Data and pagedgen: JSONL in, JSONL out.

    python examples/ray_data.py --input prompts.jsonl --output completions.jsonl \\
        --model ../shared/models/stories260K --max-tokens 64 --num-actors 2

Each input line is a JSON object with a "prompt" (or --prompt-column, or "messages", or
"prompt_token_ids") field; every field comes back unchanged with "generated_text",
"num_prompt_tokens", "num_generated_tokens", "finish_reason" and "error" added ("" unless the row
was refused, e.g. a prompt longer than max_model_len: that row keeps its place with the reason and
an empty text; the others go on).
Output lines are in input order when --preserve-order is given (else as batches finish).

Here Ray runs a local cluster (``ray.init(num_cpus=...)``): --num-actors actors with
--cpus-per-actor CPUs each, every actor one pagedgen ``LLM``; leave a CPU or so for Ray Data's read
tasks (actors taking every CPU can stall the dataset).

On a multi-machine cluster (started with ``ray start --head`` on one machine and
``ray start --address=HEAD:6379`` on the others, same Python environment and the model folder at the
same path everywhere, or on shared storage), point the same script at it with
``--address HEAD:6379`` (``ray.init(address=...)``), and give one actor per machine, or per NUMA node
(``--cpus-per-actor`` = the cores of one node, and torch's threads follow), or per GPU
(``--gpus-per-actor 1 --device cuda``). Set --num-actors to the number of those units. For outputs
too big for the driver, write with ``Dataset.write_json(folder)`` to shared storage instead of
--output (this script streams rows back to the driver and writes one file).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL = os.path.join(ROOT, "..", "shared", "models", "stories260K")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Generate for a JSONL file of prompts with Ray Data actors running pagedgen.")
    p.add_argument("--input", required=True, help="JSONL file: one object with a 'prompt' (or 'messages', 'prompt_token_ids') per line")
    p.add_argument("--output", required=True, help="JSONL file to write (the input fields plus the generated ones)")
    p.add_argument("--prompt-column", default="prompt", help="the input field holding the prompt text")
    p.add_argument("--limit", type=int, default=None, help="only the first N rows")
    p.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint folder, the same path on every machine")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per row")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed (SamplingParams.seed)")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when a GPU is visible)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences per engine step in each actor")
    p.add_argument("--num-actors", type=int, default=2, help="actors, each with one LLM")
    p.add_argument("--cpus-per-actor", type=float, default=0.5, help="Ray CPUs per actor")
    p.add_argument("--gpus-per-actor", type=float, default=0, help="Ray GPUs per actor")
    p.add_argument("--batch-size", type=int, default=64, help="rows per map_batches call (one generate call each)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="split the input into this many blocks, so that every actor gets work (default 4 per actor; "
                        "0 keeps the blocks Ray read, e.g. one per file of a large dataset)")
    p.add_argument("--address", default=None, help="an existing Ray cluster (HEAD:6379); default: start a local one")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local cluster (default: all)")
    p.add_argument("--preserve-order", action="store_true", help="write rows in input order")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import ray

    from pagedgen.integrations.ray import LLMPredictor

    if not ray.is_initialized():  # a caller (or a test) may have connected already
        if args.address:
            ray.init(address=args.address)
        else:
            ray.init(num_cpus=args.num_cpus, include_dashboard=False)
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = args.preserve_order

    sampling = dict(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    engine = dict(dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs)
    start = time.perf_counter()
    ds = ray.data.read_json(os.path.abspath(args.input))
    if args.limit is not None:
        ds = ds.limit(args.limit)
    num_blocks = 4 * args.num_actors if args.num_blocks is None else args.num_blocks
    if num_blocks:
        ds = ds.repartition(num_blocks)
    out = ds.map_batches(
        LLMPredictor,
        fn_constructor_kwargs=dict(model=os.path.abspath(args.model), sampling_params=sampling, prompt_column=args.prompt_column, **engine),
        batch_size=args.batch_size,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=args.num_actors),
        num_cpus=args.cpus_per_actor,
        num_gpus=args.gpus_per_actor or None,
    )
    rows = errors = generated = 0
    with open(args.output, "w", encoding="utf-8") as f:
        for row in out.iter_rows():
            f.write(json.dumps({k: _plain(v) for k, v in row.items()}) + "\n")
            rows += 1
            errors += bool(row["error"])
            generated += int(row["num_generated_tokens"])
    elapsed = time.perf_counter() - start
    print(f"{rows} rows ({errors} refused), {generated} generated tokens in {elapsed:.1f} s -> {args.output}")
    return 0


def _plain(value):
    """numpy scalars and arrays as JSON-ready Python values."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


if __name__ == "__main__":
    sys.exit(main())
