"""Speculative decoding (issue 34): output tok/s with speculation on vs off, side by side in one run,
and the acceptance rate by draft position.

    python benchmarks/speculative.py                 # the issue's cases (minutes on a CPU)
    python benchmarks/speculative.py --draft-model   # the draft-model cases only
    python benchmarks/speculative.py --tiny          # a smoke run (seconds)

Cases: random-135m bf16 greedy (its outputs repeat themselves, so lookup proposes right tokens) at
batch 1, 4 and 8; stories260K on prompts that end by restarting a passage they contain (lookup
mostly misses: the cost of a miss); batch 256 with disable_by_batch_size=64 (speculation off at full
batch). Draft model: stories260K with early-exit drafts of its own first two and four layers
(``pagedgen.spec.early_exit``, written to a temporary folder) and stories260K as its own draft
(every draft accepted: the upper bound of the mechanism) on TinyStories openings, greedy, at batch
1, 4 and 8. Each line: batch, tok/s off, tok/s on, ratio, accepted / proposed, acceptance by
position, and whether the outputs equal speculation off (they must: greedy).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _workload import RANDOM_MODELS, SHARED, ensure_random_model, fold_ids, gpt2_tokenizer_dir  # noqa: E402

from pagedgen import LLM, SamplingParams  # noqa: E402
from pagedgen.spec.early_exit import write_early_exit_draft  # noqa: E402

STORIES = os.path.join(SHARED, "models", "stories260K")
TINYSTORIES = os.path.join(SHARED, "data", "tinystories_valid_first1000", "tinystories_valid_first1000.jsonl")


def restart_prompts(n: int, words: int) -> list[str]:
    """Story openings of ``words`` words followed by their own first few words again."""
    out = []
    with open(TINYSTORIES) as f:
        for line in f:
            text = " ".join(json.loads(line)["text"].split()[:words])
            out.append(text + " " + " ".join(text.split()[:6]))
            if len(out) == n:
                break
    return out


def openings(n: int, words: int) -> list[str]:
    """The first ``words`` words of the first ``n`` TinyStories stories."""
    out = []
    with open(TINYSTORIES) as f:
        for line in f:
            out.append(" ".join(json.loads(line)["text"].split()[:words]))
            if len(out) == n:
                break
    return out


def draft_cases(batches, num_prompts: int, max_tokens: int, k: int) -> None:
    """stories260K with its early-exit drafts (first two, first four layers) and with itself as draft."""
    prompts = openings(num_prompts, 40)
    with tempfile.TemporaryDirectory() as tmp:
        drafts = [(f"early-exit draft ({n} of 5 layers)", write_early_exit_draft(STORIES, os.path.join(tmp, f"early_exit_{n}"), n)) for n in (2, 4)]
        for name, draft in drafts + [("itself as draft", STORIES)]:
            spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
            case(f"stories260K, {name}", STORIES, prompts, batches, max_tokens, spec, "float32")


def run(model: str, prompts: list, batch: int, max_tokens: int, spec: dict | None, dtype: str) -> dict:
    llm = LLM(model, dtype=dtype, max_num_seqs=batch, num_kv_blocks=max(64, batch * 64), max_model_len=512,
              speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:batch], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    s = llm.get_stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return dict(tok_s=tokens / elapsed, ids=[o.outputs[0].token_ids for o in outs], proposed=s.num_draft_tokens,
                accepted=s.num_accepted_tokens, by_position=s.acceptance_rate_per_position)


def case(name: str, model: str, prompts: list, batches, max_tokens: int, spec: dict, dtype: str) -> None:
    for batch in batches:
        off = run(model, prompts, batch, max_tokens, None, dtype)
        on = run(model, prompts, batch, max_tokens, spec, dtype)
        same = "equal" if on["ids"] == off["ids"] else "DIFFERENT"
        rate = on["accepted"] / on["proposed"] if on["proposed"] else 0.0
        print(f"{name} batch {batch}: off {off['tok_s']:,.0f} tok/s, on {on['tok_s']:,.0f} tok/s, {on['tok_s'] / off['tok_s']:.2f}x; "
              f"accepted {on['accepted']:,}/{on['proposed']:,} ({rate:.1%}), by position {on['by_position']}; outputs {same}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a smoke run: stories260K only, small")
    ap.add_argument("--draft-model", action="store_true", help="only the draft-model cases")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    args = ap.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    if args.tiny:
        case("stories260K restart", STORIES, restart_prompts(8, 40), (1, 4), 32, spec, "float32")
        draft_cases((1, 4), 8, 32, args.k)
        return
    if args.draft_model:
        draft_cases((1, 4, 8), 64, 128, args.k)
        return
    model, _ = ensure_random_model("random-135m", "bfloat16")
    prompts = restart_prompts(64, 60)
    from transformers import AutoTokenizer

    # its GPT-2 tokenizer holds ids past the model's 49,152: those are folded in (_workload.fold_ids)
    ids, _ = fold_ids(AutoTokenizer.from_pretrained(gpt2_tokenizer_dir())(prompts[:16])["input_ids"], RANDOM_MODELS["random-135m"]["vocab_size"])
    case("random-135m bf16", model, ids, (1, 4, 8), 128, spec, "bfloat16")
    case("stories260K restart", STORIES, prompts, (1, 4, 8), 128, spec, "float32")
    case("stories260K batch 256, disable_by_batch_size 64", STORIES, restart_prompts(256, 60), (256,), 64,
         dict(spec, disable_by_batch_size=64), "float32")
    draft_cases((1, 4, 8), 64, 128, args.k)


if __name__ == "__main__":
    main()
