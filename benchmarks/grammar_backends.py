"""llguidance vs xgrammar on pagedgen's tokenizers (issue 33: how the grammar backend was chosen).

For each tokenizer (stories260K's SentencePiece-style vocabulary of 512 with byte fallback; GPT-2's
BPE cut to the tiny test models' first 4,096 ids, EOS the text token "!" = id 0; GPT-2 in full,
EOS 50256) and each of the ten JSON schemas of tests/support/json_schemas.py, both backends
compile the schema (compact JSON) and walk it with random allowed tokens (seeded) until the grammar
ends or 80 tokens: compile time, mean per-token mask time, and whether each finished walk decodes
to JSON that validates against its schema. One thread, no engine. Needs ``pip install
xgrammar==0.2.9`` (not a pagedgen dependency).

    python benchmarks/grammar_backends.py
"""
from __future__ import annotations

import json
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))


def _walk(fill, accept, done, words: int, vocab: int, rng: random.Random, max_len: int = 80):
    """(mask seconds, masks, tokens, "done" or "length"): random allowed tokens until the grammar ends."""
    import torch

    bitmask = torch.zeros(1, words, dtype=torch.int32)
    spent, tokens = 0.0, []
    for _ in range(max_len):
        start = time.perf_counter()
        fill(bitmask)
        spent += time.perf_counter() - start
        bits = ((bitmask[0].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]
        token = rng.choice(bits.nonzero().flatten().tolist())
        tokens.append(token)
        assert accept(token), token
        if done():
            return spent, len(tokens), tokens, "done"
    return spent, len(tokens), tokens, "length"


def main() -> None:
    import jsonschema
    import llguidance as llg
    import torch
    import transformers
    import xgrammar as xgr
    from conftest import GPT2_TOKENIZER
    from conftest import STORIES as STORIES_PATH
    from json_schemas import SCHEMAS

    from pagedgen.structured_output.grammar import fill_bitmask_rows
    from pagedgen.structured_output.vocabulary import Vocabulary

    torch.set_num_threads(1)
    gpt2 = transformers.AutoTokenizer.from_pretrained(GPT2_TOKENIZER)
    tokenizers = [("stories260K (512)", transformers.AutoTokenizer.from_pretrained(STORIES_PATH), 512, [2]),
                  ("GPT-2 cut to 4,096, EOS '!'", gpt2, 4096, [0]), ("GPT-2 (50,257)", gpt2, 50257, [50256])]
    for name, tok, vocab, eos in tokenizers:
        words = (vocab + 31) // 32
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=eos)
        xcompiler = xgr.GrammarCompiler(info, max_threads=1)
        table = Vocabulary(tok, vocab, frozenset(eos))
        for backend in ("xgrammar", "llguidance"):
            compile_s = mask_s = masks = 0
            results = []
            for i, schema in enumerate(SCHEMAS):
                text = json.dumps(schema)
                start = time.perf_counter()
                if backend == "xgrammar":
                    m = xgr.GrammarMatcher(xcompiler.compile_json_schema(text, any_whitespace=False))
                    fill, accept, done = (lambda b, m=m: m.fill_next_token_bitmask(b, 0)), m.accept_token, m.is_terminated
                else:
                    grammar = llg.LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
                    m = llg.LLMatcher(table.ll_tokenizer, grammar, log_level=0)
                    fill, accept, done = (lambda b, m=m: fill_bitmask_rows([(m, 0)], b)), m.consume_token, m.is_stopped
                compile_s += time.perf_counter() - start
                spent, n, tokens, status = _walk(fill, accept, done, words, vocab, random.Random(i))
                mask_s, masks = mask_s + spent, masks + n
                if status == "done":
                    try:
                        jsonschema.validate(json.loads(tok.decode([t for t in tokens if t not in eos])), schema)
                        status = "valid"
                    except (ValueError, jsonschema.ValidationError) as exc:
                        status = f"INVALID ({type(exc).__name__})"
                results.append(status)
            valid = results.count("valid")
            print(f"{name:28s} {backend:10s} compile {1e3 * compile_s / len(SCHEMAS):5.1f} ms/schema, mask {1e6 * mask_s / masks:5.0f} "
                  f"us/token; {valid}/{len(SCHEMAS)} valid; {', '.join(f'#{i} {r}' for i, r in enumerate(results) if r != 'valid')}")


if __name__ == "__main__":
    main()
