"""Structured outputs at batch speed (issue 33): the same requests with a JSON schema and without.

random-135m (SmolLM-135M's shape, random bf16 weights, built once by benchmarks/_workload.py) and
its GPT-2 tokenizer; N TinyStories openings, temperature 1 with a seed per request. An untimed
first pass runs every request under a JSON schema (objects, an enum array, integer and number
ranges, bounded strings) until its JSON ends (EOS) or max_tokens, which gives each request's length
(and touches every KV page once); then, timed, the same requests unconstrained with ignore_eos and
each one's max_tokens set to that length, and the constrained requests again, so both sides
generate the same tokens per request and output tok/s compare one for one.
Reported: output tok/s of each side and their ratio (the target is >= 0.9), the schema's compile
time and the token table's (once per tokenizer), the mean per-step time of filling the bitmask (and
per constrained row), the steps and the share of tokens jump-forward decoding appended
(``--no-jump-forward`` to run without it), and how many constrained outputs parse and validate (all must).

The model has no EOS of its own; the benchmark makes id 50 of its vocabulary the EOS (a byte-level
BPE token like any other, which the grammar then never uses as text) for both sides.

    python benchmarks/structured.py                                 # 256 requests, max_tokens 256
    python benchmarks/structured.py --requests 16 --max-tokens 64 --model stories260K   # a smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import _workload  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["happy", "sad", "brave", "kind", "small"]}, "minItems": 1, "maxItems": 3},
        "score": {"type": "number", "multipleOf": 0.25, "minimum": -10, "maximum": 10},
        "friend": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "years": {"type": "integer", "minimum": 0, "maximum": 99}},
                   "required": ["name", "years"], "additionalProperties": False},
    },
    "required": ["name", "age", "tags", "score", "friend"],
    "additionalProperties": False,
}
EOS_ID = 50  # random-135m has no EOS: this id becomes one (see the module docstring)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random-135m", help="random-135m (default), or stories260K / a checkpoint folder")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--disable-any-whitespace", action=argparse.BooleanOptionalAction, default=True,
                    help="compact JSON (default on: a random model left free writes whitespace runs)")
    ap.add_argument("--mask", choices=["auto", "overlap", "serial", "both", "all"], default="auto",
                    help="fill each step's bitmask where it pays (default: the engine's own choice), during the forward, before it, "
                         "serial and overlap side by side (two timed constrained runs), or all three")
    ap.add_argument("--repeats", type=int, default=1,
                    help="timed runs of each side, interleaved (unconstrained, then each mask mode, then again); medians reported")
    ap.add_argument("--close-at-max-tokens", action=argparse.BooleanOptionalAction, default=True,
                    help="StructuredOutputsParams.close_at_max_tokens (default on, as the library's default)")
    ap.add_argument("--jump-forward", action=argparse.BooleanOptionalAction, default=True,
                    help="append the tokens a grammar forces without a decode step each (default on)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    return ap.parse_args(argv)


def _ids(outs) -> list:
    return [list(o.outputs[0].token_ids) for o in outs]


def main(argv=None) -> dict:
    args = parse_args(argv)
    import jsonschema
    from transformers import AutoTokenizer

    from pagedgen import LLM, SamplingParams, StructuredOutputsParams

    if args.model in _workload.RANDOM_MODELS:
        folder, built = _workload.ensure_random_model(args.model, args.dtype)
        print(f"{args.model}: {'built' if built else 'cached'} at {folder}", flush=True)
    elif args.model == "stories260K":
        folder = _workload.asset("models/stories260K", "stories260K")
    else:
        folder = args.model
    tokenizer = AutoTokenizer.from_pretrained(folder)
    llm = LLM(folder, dtype=args.dtype, max_num_seqs=args.max_num_seqs, device=args.device)
    vocab = llm.model_config.vocab_size
    if args.model in _workload.RANDOM_MODELS:
        llm.eos_token_ids = frozenset([EOS_ID])
    prompts, _ = _workload.load_workload("tinystories", tokenizer, num_prompts=args.requests, min_tokens=1, max_tokens=1,
                                         max_prompt_tokens=None, max_model_len=llm.scheduler_config.max_model_len - args.max_tokens, seed=0)
    prompts, _ = _workload.fold_ids(prompts, vocab)
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=args.disable_any_whitespace, close_at_max_tokens=args.close_at_max_tokens)

    warm = _workload.warmup_prompts(prompts)
    llm.generate(warm, [SamplingParams(temperature=1.0, seed=i, max_tokens=8, structured_outputs=spec) for i in range(len(warm))],
                 use_tqdm=False)  # untimed: first-step costs, and the token table and the schema's compile (reported apart)

    compiler, grammars = llm.processor.grammars, llm.llm_engine.grammars
    grammars.jump_forward = args.jump_forward
    constrained = [SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens, structured_outputs=spec) for i in range(len(prompts))]
    # untimed first pass: each request's length under the schema (and every KV page touched once)
    lengths = [len(o.outputs[0].token_ids) for o in llm.generate(prompts, constrained, use_tqdm=False)]
    free = [SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True) for i, n in enumerate(lengths)]
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")

    def free_run():
        start = time.perf_counter()
        outs = llm.generate(prompts, free, use_tqdm=False)
        return outs, time.perf_counter() - start

    def constrained_run(overlap, t_free: float, free_tokens: int):
        grammars.overlap = overlap  # True, False, or None: the engine decides (StructuredOutputManager.overlaps)
        stats0 = llm.get_stats()
        steps0, jump0, mask0, wait0, masks0 = stats0.num_steps, stats0.num_jump_forward_tokens, grammars.mask_seconds, grammars.mask_wait_seconds, grammars.num_masks
        start = time.perf_counter()
        outs = llm.generate(prompts, constrained, use_tqdm=False)
        seconds = time.perf_counter() - start
        stats1 = llm.get_stats()
        steps, rows, jumped = stats1.num_steps - steps0, max(1, grammars.num_masks - masks0), stats1.num_jump_forward_tokens - jump0
        mask_s, wait_s = grammars.mask_seconds - mask0, grammars.mask_wait_seconds - wait0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)  # = free_tokens where runs are batch invariant (the CPU's default)
        return outs, tokens, seconds, {
            "output_tokens": tokens, "constrained_tok_s": tokens / seconds, "ratio": (tokens / seconds) / (free_tokens / t_free),
            "mask_ms_per_step": 1e3 * mask_s / max(1, steps), "mask_us_per_row": 1e6 * mask_s / rows,
            "mask_wait_ms_per_step": 1e3 * wait_s / max(1, steps), "mask_share_of_constrained_time": mask_s / seconds,
            "steps": steps, "jump_forward_tokens": jumped, "jump_forward_share": jumped / max(1, tokens),
        }

    modes = {"auto": [None], "overlap": [True], "serial": [False], "both": [False, True], "all": [False, True, None]}[args.mask]
    mode_name = {None: "auto", True: "overlap", False: "serial"}
    free_times, all_runs = [], {mode_name[o]: [] for o in modes}
    for repeat in range(args.repeats):  # interleaved, so that drift of a shared machine hits every side alike
        outs_free, t = free_run()
        free_times.append(t)
        free_tokens = sum(len(o.outputs[0].token_ids) for o in outs_free)
        for o in modes:
            all_runs[mode_name[o]].append(constrained_run(o, t, free_tokens))
        print(f"repeat {repeat + 1}/{args.repeats}: unconstrained {free_tokens / t:.1f} tok/s, "
              + ", ".join(f"{m} {r[-1][3]['constrained_tok_s']:.1f} tok/s ({r[-1][3]['ratio']:.3f}x)" for m, r in all_runs.items()), flush=True)
    t_free = statistics.median(free_times)

    def median_run(results):  # the run of median seconds (odd repeats) with the ratio to the median unconstrained run
        r = sorted(results, key=lambda x: x[2])[(len(results) - 1) // 2]
        stats = dict(r[3], ratio=(r[1] / r[2]) / (free_tokens / t_free), ratios_by_repeat=[x[3]["ratio"] for x in results])
        return r[0], r[1], r[2], stats

    runs = {m: median_run(r) for m, r in all_runs.items()}
    outs, tokens, _, main_run = runs[mode_name[modes[-1]]]
    if any(_ids(x[0]) != _ids(outs) for r in all_runs.values() for x in r):
        raise SystemExit("constrained runs (serial / overlapped masks, repeats) gave different outputs")
    valid, finish = 0, {}
    for o in outs:
        c = o.outputs[0]
        finish[c.finish_reason] = finish.get(c.finish_reason, 0) + 1
        try:
            jsonschema.validate(json.loads(c.text), SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass

    result = {
        "model": args.model, "dtype": args.dtype, "device": str(llm.device), "requests": len(prompts), "max_tokens": args.max_tokens, "repeats": args.repeats,
        "output_tokens": tokens, "unconstrained_output_tokens": free_tokens,
        "unconstrained_tok_s": free_tokens / t_free, **main_run,
        "schema_compile_ms": 1e3 * compiler.compile_seconds, "num_compiled": compiler.num_compiled,
        "token_table_ms": 1e3 * compiler.vocabulary_seconds,
        **({f"{mode}_{k}": v for mode, r in runs.items() for k, v in r[3].items()} if len(runs) > 1 else {}),
        "valid": valid, "finish_reasons": finish,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if valid != finish.get("stop", 0):
        raise SystemExit(f"{finish.get('stop', 0) - valid} outputs that ended on EOS are not valid JSON of the schema")
    return result


if __name__ == "__main__":
    main()
