"""Command line for dataset-scale runs: prompts from a .jsonl or .txt file, completions to .jsonl.

    python -m pagedgen --model ../shared/models/stories260K --input prompts.jsonl --output out.jsonl \\
        --max-tokens 128 --temperature 0.8

Input: a .jsonl file with one JSON object per line holding the prompt in ``--prompt-field``
(default "prompt"), or any other file with one prompt per line (an empty line is an empty prompt,
generated from BOS alone). Output: one JSON object per prompt,
in input order: {"index", "prompt", "num_cached_tokens", "completions": [{"text", "token_ids",
"finish_reason", "stop_reason"}]}. KV-cache and scheduling statistics go to stderr at the end.
Every input line is read and checked, and the output path tried, before any generation starts; an
existing output file keeps its contents unless the run succeeds.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict


def read_prompts(path: str, field: str) -> list[str]:
    """Prompts of ``path`` (.jsonl: ``field`` of each object; otherwise one per line).

    Raises ValueError naming the line of a malformed record; FileNotFoundError for a missing file.
    """
    prompts = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not path.endswith(".jsonl"):
                prompts.append(line.rstrip("\n"))
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get(field), str):
                raise ValueError(f"{path}:{lineno}: expected an object with a string field {field!r}")
            prompts.append(record[field])
    return prompts


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pagedgen", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="Hugging Face checkpoint folder")
    ap.add_argument("--input", required=True, help=".jsonl (see --prompt-field) or text file, one prompt per line")
    ap.add_argument("--output", required=True, help="where to write the completions (.jsonl)")
    ap.add_argument("--prompt-field", default="prompt", help="field of each .jsonl object holding the prompt")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--n", type=int, default=1, help="completions per prompt")
    ap.add_argument("--seed", type=int, default=None, help="per-request seed (reproducible completions)")
    ap.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--no-tqdm", action="store_true")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from pagedgen import LLM, SamplingParams

    try:
        prompts = read_prompts(args.input, args.prompt_field)
        params = SamplingParams(
            n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
            max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos,
        )
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"pagedgen: error: {exc}", file=sys.stderr)
        return 2
    # check the output path before any work: one that cannot be written fails now, not after generating
    # (opened for append, so an existing file keeps its contents until the results replace them)
    existed = os.path.exists(args.output)
    try:
        open(args.output, "a", encoding="utf-8").close()
    except OSError as exc:
        print(f"pagedgen: error: cannot write --output {args.output!r}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    try:
        llm = LLM(
            args.model, dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs,
            num_kv_blocks=args.num_kv_blocks, enable_prefix_caching=not args.no_prefix_caching,
        )
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=not args.no_tqdm)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        if not existed:
            os.remove(args.output)
        print(f"pagedgen: error: {exc}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    with open(args.output, "w", encoding="utf-8") as f:
        for i, out in enumerate(outputs):
            completions = [
                {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                for c in out.outputs
            ]
            record = {"index": i, "prompt": out.prompt, "num_cached_tokens": out.num_cached_tokens, "completions": completions}
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    stats = llm.get_stats()
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    print(f"{len(outputs)} prompts, {tokens} output tokens in {elapsed:.2f} s ({tokens / max(elapsed, 1e-9):,.0f} tok/s)", file=sys.stderr)
    print(json.dumps(asdict(stats), indent=1), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
