"""Tiny random-weight checkpoints of every supported family, built from a transformers config and
saved as a Hugging Face folder (config.json + model.safetensors + the GPT-2 tokenizer files), for
the model-vs-transformers tests (vLLM's tests/models/language/generation/test_common.py pattern).

Weights are drawn with a large ``initializer_range`` so that greedy outputs differ between prompts
(with transformers' default 0.02 a random model repeats one token whatever the prompt). The
vocabulary is the first ``VOCAB`` ids of the GPT-2 tokenizer: tests give prompts as token ids, and
a small lm_head keeps the tests fast.
"""
from __future__ import annotations

import os
import shutil

from conftest import GPT2_TOKENIZER

VOCAB = 4096  # the first 4096 ids of the GPT-2 tokenizer (prompts are token ids), a cheap lm_head
HIDDEN, HEADS, LAYERS, MAX_POS = 64, 4, 2, 256
INIT = 0.3

# name -> (transformers config class, its arguments). Each entry is one family or one variant of
# a family's flags; together they cover every layer of pagedgen.layers.
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", dict(
        intermediate_size=128, num_key_value_heads=2, attention_bias=True, mlp_bias=True,
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=4.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=64),
    )),
    # every layer attends over the last 16 tokens: prompts and completions are longer
    "mistral": ("MistralConfig", dict(intermediate_size=128, num_key_value_heads=1, head_dim=16, sliding_window=16)),
    # layer 0 full attention, layer 1 a 24-token window (Qwen2's max_window_layers)
    "qwen2": ("Qwen2Config", dict(
        intermediate_size=128, num_key_value_heads=2, tie_word_embeddings=True,
        use_sliding_window=True, sliding_window=24, max_window_layers=1,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=2.0, original_max_position_embeddings=128),
    )),
    "qwen3": ("Qwen3Config", dict(intermediate_size=128, num_key_value_heads=2, head_dim=32, attention_bias=True)),
    "phi3": ("Phi3Config", dict(
        intermediate_size=128, num_key_value_heads=2, pad_token_id=0,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
    )),
    "gemma": ("GemmaConfig", dict(intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=256, pad_token_id=0)),
    "gpt2": ("GPT2Config", dict(n_embd=HIDDEN, n_head=HEADS, n_layer=LAYERS, n_positions=MAX_POS, scale_attn_by_inverse_layer_idx=True)),
    "opt": ("OPTConfig", dict(ffn_dim=128, word_embed_proj_dim=HIDDEN, pad_token_id=1)),
    "opt-postnorm-proj": ("OPTConfig", dict(ffn_dim=128, word_embed_proj_dim=32, do_layer_norm_before=False, pad_token_id=1)),
    "gpt_neox": ("GPTNeoXConfig", dict(intermediate_size=128, use_parallel_residual=True)),
    "gpt_neox-sequential": ("GPTNeoXConfig", dict(intermediate_size=128, use_parallel_residual=False, rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))),
}

_COMMON = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=LAYERS,
    max_position_embeddings=MAX_POS, initializer_range=INIT, bos_token_id=0, eos_token_id=0,
)


def hf_config(name: str, **overrides):
    """The transformers config of the family ``name`` (``overrides``: config arguments replaced)."""
    import transformers

    cls_name, kwargs = FAMILIES[name]
    cls = getattr(transformers, cls_name)
    args = {k: v for k, v in _COMMON.items() if cls_name != "GPT2Config" or k not in ("hidden_size", "num_attention_heads", "num_hidden_layers", "max_position_embeddings")}
    args.update(kwargs)
    args.update(overrides)
    if cls_name == "OPTConfig":
        args["init_std"] = INIT
    return cls(**args)


def build(name: str, folder: str, seed: int = 0, **overrides):
    """Save a random-weight checkpoint of family ``name`` in ``folder`` (``overrides``: config
    arguments replaced); returns transformers' model (float32, eval mode, eager attention), the oracle."""
    import torch
    import transformers

    config = hf_config(name, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None  # generate the full length, as ignore_eos does
    model.generation_config.pad_token_id = config.pad_token_id if config.pad_token_id is not None else 0
    model.save_pretrained(folder, safe_serialization=True)
    copy_tokenizer(folder)
    return model


def build_classifier(name: str, folder: str, num_labels: int, seed: int = 0, **overrides):
    """Save a random-weight ``*ForSequenceClassification`` checkpoint of family ``name`` with
    ``num_labels`` outputs (labels named ``id2label``: "neg", "pos", "label_2"...) in ``folder``;
    returns transformers' model (float32, eval mode, eager attention), the oracle."""
    import torch
    import transformers

    names = {i: ("neg", "pos")[i] if i < 2 else f"label_{i}" for i in range(num_labels)}
    config = hf_config(name, num_labels=num_labels, id2label=names, label2id={v: k for k, v in names.items()}, pad_token_id=0, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    model.save_pretrained(folder, safe_serialization=True)
    copy_tokenizer(folder)
    return model


def copy_tokenizer(folder: str) -> None:
    """The GPT-2 tokenizer's files into ``folder`` (prompts are token ids below ``VOCAB``)."""
    for f in os.listdir(GPT2_TOKENIZER):
        if f.endswith((".json", ".txt")):
            shutil.copy(os.path.join(GPT2_TOKENIZER, f), folder)
