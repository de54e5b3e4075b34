"""Offline batch generation: story openings from TinyStories completed by the stories260K Llama.

    python examples/offline_batch.py                      # 1,000 prompts, defaults below
    python examples/offline_batch.py --num-prompts 50 --temperature 0.8 --max-tokens 128

Prints throughput, KV cache utilisation, preemptions and three sample completions.
"""
import argparse
import json
import os
import random
import time

from pagedgen import LLM, SamplingParams

HERE = os.path.dirname(os.path.abspath(__file__))
SHARED = os.path.join(os.path.dirname(os.path.dirname(HERE)), "shared")


def story_openings(path: str, num_prompts: int, seed: int) -> list[str]:
    """The first 4 to 24 words of each of the first ``num_prompts`` stories in a jsonl file."""
    rng = random.Random(seed)
    prompts = []
    with open(path) as f:
        for line in f:
            words = json.loads(line)["text"].split()
            prompts.append(" ".join(words[: rng.randint(4, 24)]))
            if len(prompts) == num_prompts:
                break
    if len(prompts) < num_prompts:
        raise SystemExit(f"{path} holds only {len(prompts)} stories, {num_prompts} asked for")
    return prompts


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)  # --max-token is an error, not --max-tokens
    ap.add_argument("--model", default=os.path.join(SHARED, "models", "stories260K"), help="checkpoint folder")
    ap.add_argument(
        "--data",
        default=os.path.join(SHARED, "data", "tinystories_valid_first1000", "tinystories_valid_first1000.jsonl"),
        help="jsonl file with a 'text' field per line",
    )
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache size in blocks (default: from memory)")
    ap.add_argument("--max-model-len", type=int, default=None, help="most tokens per sequence (default: the model's); the KV cache must hold one")
    ap.add_argument("--n", type=int, default=1, help="completions per prompt (parallel sampling)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--no-tqdm", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)

    prompts = story_openings(args.data, args.num_prompts, args.seed)
    llm = LLM(args.model, max_num_seqs=args.max_num_seqs, num_kv_blocks=args.num_kv_blocks, max_model_len=args.max_model_len, seed=args.seed, device=args.device)
    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens)

    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.no_tqdm)
    elapsed = time.perf_counter() - start

    stats = llm.get_stats()
    out_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    in_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    print(f"\n{len(outputs)} requests, {in_tokens} prompt tokens, {out_tokens} output tokens in {elapsed:.2f} s")
    print(f"throughput: {out_tokens / elapsed:,.0f} output tokens/s, {len(outputs) / elapsed:.1f} requests/s")
    print(
        f"KV cache: {stats.num_kv_blocks} blocks of {stats.block_size} tokens, peak {stats.peak_used_blocks} in use; "
        f"utilisation (real tokens / allocated slots) mean {stats.kv_utilization_mean:.1%}"
    )
    print(
        f"steps: {stats.num_steps}, preemptions: {stats.num_preemptions} "
        f"({stats.num_recomputes} recomputed, {stats.num_swaps_out} swapped)"
    )
    print(
        f"sharing: prefix-cache hit rate {stats.prefix_cache_hit_rate:.1%}, blocks saved by sharing "
        f"mean {stats.sharing_savings_mean:.1%} (peak {stats.peak_sharing_savings:.1%}), "
        f"{stats.num_copy_on_write} copy-on-write block copies"
    )
    for o in outputs[:3]:
        print("-" * 80)
        print(f"[{o.request_id}] {o.prompt!r}\n  -> {o.outputs[0].text!r} ({o.outputs[0].finish_reason})")


if __name__ == "__main__":
    main()
