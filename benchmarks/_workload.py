"""Models and workloads of benchmarks/throughput.py: checkpoint facts, random-weight checkpoints, prompts.

Random-weight Llamas (``RANDOM_MODELS``) are built from a transformers ``LlamaConfig`` in the requested
dtype with ``torch.manual_seed(0)`` and cached in the git-ignored ``benchmarks/.models/<name>-<dtype>-
<hash>/``, saved with the GPT-2 tokenizer (50,257 ids). That tokenizer covers every id the models can
emit (their vocabularies are 49,152 and 32,000), but its prompts can hold ids past a model's
vocabulary: those are folded into it (``id % vocab_size``, see ``fold_ids``), which keeps every
prompt's length; the weights are random, so no meaning is lost. GPT-2's EOS (50,256) lies outside both
vocabularies: the configs carry no EOS/BOS, and every run sets ignore_eos.
"""
from __future__ import annotations

import csv
import hashlib
import json
import os
import random
import shutil
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SHARED = os.path.join(os.path.dirname(ROOT), "shared")
GPU_ASSETS = os.path.join(ROOT, ".gpu_assets")  # the GPU machine sees only the checkout
MODEL_CACHE = os.path.join(HERE, ".models")  # git-ignored
RANDOM_MAX_LEN = 2048  # both models' context (max_position_embeddings), tokens
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

RANDOM_MODELS = {
    "random-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                        num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True),  # SmolLM-135M
    # random-135m with GPT-2's whole vocabulary: for benchmarks that feed text (lm_eval_tasks.py), whose
    # token ids cannot be folded as above
    "random-135m-text": dict(vocab_size=50257, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                             num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True),
    "random-1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                      num_attention_heads=32, num_key_value_heads=4, tie_word_embeddings=False),  # TinyLlama-1.1B
}
# The issue-9 workloads: prompts and output-length limits (argparse defaults come from here)
WORKLOADS = {
    "tinystories": dict(num_prompts=256, min_tokens=16, max_tokens=256, max_prompt_tokens=None),
    "sharegpt": dict(num_prompts=128, min_tokens=1, max_tokens=512, max_prompt_tokens=1024),
}


def asset(shared_rel: str, gpu_name: str) -> str:
    """``.gpu_assets/<gpu_name>`` inside the checkout when it exists, else ``../shared/<shared_rel>``."""
    local = os.path.join(GPU_ASSETS, gpu_name)
    return local if os.path.exists(local) else os.path.join(SHARED, shared_rel)


def gpt2_tokenizer_dir() -> str:
    return asset("models/gpt2-tokenizer", "gpt2-tokenizer")


def model_info(model: str, dtype: str) -> dict:
    """Shape facts of ``model`` (a checkpoint folder or a RANDOM_MODELS name), without loading weights.

    Returns dict(config: the config.json fields used here, tokenizer: folder, dtype: resolved dtype,
    max_model_len: tokens, kv_bytes_per_token: K and V of all layers, random: bool). ``dtype`` "auto"
    means the checkpoint's (bfloat16 for the random models). Raises SystemExit for a folder without
    config.json.
    """
    if model in RANDOM_MODELS:
        cfg = dict(RANDOM_MODELS[model], max_position_embeddings=RANDOM_MAX_LEN)
        tokenizer, own_dtype = gpt2_tokenizer_dir(), "bfloat16"
    else:
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise SystemExit(f"no config.json in {model}: give a checkpoint folder, {' or '.join(RANDOM_MODELS)}")
        with open(os.path.join(model, "config.json")) as f:
            cfg = json.load(f)
        tokenizer, own_dtype = model, cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    dtype = own_dtype if dtype == "auto" else dtype
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    kv_bytes_per_token = 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * DTYPE_BYTES.get(dtype, 4)
    return dict(config=cfg, tokenizer=tokenizer, dtype=dtype, max_model_len=cfg["max_position_embeddings"],
                kv_bytes_per_token=kv_bytes_per_token, random=model in RANDOM_MODELS)


def random_model_dir(name: str, dtype: str) -> str:
    """Cache folder of the random checkpoint ``name`` in ``dtype`` (its name hashes the shape)."""
    digest = hashlib.sha256(json.dumps(RANDOM_MODELS[name], sort_keys=True).encode()).hexdigest()[:10]
    return os.path.join(MODEL_CACHE, f"{name}-{dtype}-{digest}")


def ensure_random_model(name: str, dtype: str) -> tuple[str, bool]:
    """(folder, built now): the cached random-weight checkpoint, built first if missing."""
    folder = random_model_dir(name, dtype)
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder, False
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tok = AutoTokenizer.from_pretrained(gpt2_tokenizer_dir())
    shape = RANDOM_MODELS[name]
    if len(tok) < shape["vocab_size"]:
        raise SystemExit(f"the GPT-2 tokenizer has {len(tok)} ids, fewer than {name}'s vocabulary {shape['vocab_size']}")
    config = LlamaConfig(max_position_embeddings=RANDOM_MAX_LEN, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))  # built in dtype, no fp32 copy
    os.makedirs(MODEL_CACHE, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}-", dir=MODEL_CACHE)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        os.replace(tmp, folder)  # atomic: a half-written folder is never taken for a cached one
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isfile(os.path.join(folder, "config.json")):  # not a concurrent run that finished first
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder, True


def fold_ids(prompts: list[list[int]], vocab_size: int) -> tuple[list[list[int]], int]:
    """(prompts with every id ``t >= vocab_size`` replaced by ``t % vocab_size``, number replaced)."""
    folded = sum(t >= vocab_size for p in prompts for t in p)
    return [[t % vocab_size for t in p] for p in prompts], folded


def load_workload(name: str, tokenizer, *, num_prompts: int, min_tokens: int, max_tokens: int,
                  max_prompt_tokens: int | None, max_model_len: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """Prompt token ids and per-request max_tokens (output tokens, exact with ignore_eos).

    tinystories: the first ``num_prompts`` TinyStories validation stories, each cut to its first 4..24
    words (seeded), tokenised; max_tokens drawn uniformly from [min_tokens, max_tokens] (seeded).
    sharegpt: the first human turns of the first ``num_prompts`` ShareGPT conversations
    (sharegpt_prompts_mlenergy), tokenised, cut to ``max_prompt_tokens``; max_tokens = the decode token
    counts of the first ``num_prompts`` rows of the sarathi ShareGPT length table, clipped to
    [min_tokens, max_tokens]. Either way prompt + max_tokens is cut to ``max_model_len``.
    Raises SystemExit when the data holds fewer than ``num_prompts`` records.
    """
    rng = random.Random(seed)
    if name == "tinystories":
        path = asset("data/tinystories_valid_first1000/tinystories_valid_first1000.jsonl", "tinystories_valid_first1000.jsonl")
        with open(path) as f:
            records = [json.loads(line)["text"].split() for _, line in zip(range(num_prompts), f)]
        texts = [" ".join(words[: rng.randint(4, 24)]) for words in records]  # first 4..24 words
        limits = [rng.randint(min_tokens, max_tokens) for _ in texts]
    else:
        path = asset("data/sharegpt_prompts_mlenergy/ShareGPT_V3_filtered_1000.json", "sharegpt_prompts.json")
        with open(path) as f:
            records = [r["conversations"][0]["value"] for r in json.load(f)[:num_prompts]]
        texts = records
        lengths = asset("data/sharegpt_lengths_sarathi/sharegpt_8k_filtered_stats_llama2_tokenizer.csv", "sharegpt_lengths.csv")
        with open(lengths) as f:
            limits = [min(max(int(r["num_decode_tokens"]), min_tokens), max_tokens) for _, r in zip(range(num_prompts), csv.DictReader(f))]
    if len(records) < num_prompts or len(limits) < num_prompts:
        raise SystemExit(f"{path} holds only {min(len(records), len(limits))} records, {num_prompts} asked for")
    prompts = []
    for ids, m in zip(tokenizer(texts)["input_ids"], limits):
        cap = min(max_prompt_tokens or len(ids), max_model_len - min(m, max_model_len - 1))
        prompts.append(list(ids[: max(1, cap)]))
    limits = [min(m, max_model_len - len(p)) for p, m in zip(prompts, limits)]
    return prompts, limits


def warmup_prompts(prompts: list[list[int]]) -> list[list[int]]:
    """Untimed warm-up prompts: the first 8, reversed (no prefix in common with the timed prompts)."""
    return [p[::-1] for p in prompts[:8]]
