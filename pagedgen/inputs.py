"""Validation of what users pass to ``LLM``: devices, sizes, prompts and sampling parameters.

Every check runs before any work starts and raises ``TypeError`` (wrong type) or ``ValueError``
(out of range), naming the field, the request index and the allowed range.
"""
from __future__ import annotations

import numbers
from typing import Optional

import torch

from pagedgen.sampling_params import SamplingParams


def resolve_device(device) -> torch.device:
    """``None`` -> cuda when available, else cpu; anything else must name a usable device."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"LLM device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from exc
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"LLM device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"LLM device {device!r} asked for, but torch sees no CUDA GPU")
    return dev


def check_positive_int(name: str, value, allow_none: bool = False) -> None:
    """``value`` must be an int >= 1 (or None when ``allow_none``); the message names ``LLM name``."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"LLM {name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"LLM {name} must be >= 1, got {value}")


def tokenize_prompts(tokenizer, prompts, vocab_size: int) -> tuple[list[Optional[str]], list[list[int]]]:
    """Validate ``prompts`` (a str, a list of str, or a list of token-id lists, not mixed) and
    return (texts or None per prompt, token ids per prompt). Raises TypeError / ValueError naming
    the prompt's index."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a str, a list of str or a list of token-id lists, got {type(prompts).__name__}")
    if not prompts:
        return [], []
    first_is_text = isinstance(prompts[0], str)
    for i, p in enumerate(prompts):
        if first_is_text and not isinstance(p, str):
            raise TypeError(f"prompts[{i}] is a {type(p).__name__}, but prompts[0] is a str: do not mix prompt types")
        if not first_is_text:
            if isinstance(p, str):
                raise TypeError(f"prompts[{i}] is a str, but prompts[0] is a token-id list: do not mix prompt types")
            if not isinstance(p, (list, tuple)):
                raise TypeError(f"prompts[{i}] must be a list of int token ids, got {type(p).__name__}")
            for j, t in enumerate(p):
                if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                    raise TypeError(f"prompts[{i}][{j}] must be an int token id, got {type(t).__name__} {t!r}")
    vocab = vocab_size
    if first_is_text:
        texts = list(prompts)
        ids = [list(x) for x in tokenizer(texts, add_special_tokens=True)["input_ids"]]
    else:
        texts = [None] * len(prompts)
        ids = [[int(t) for t in p] for p in prompts]  # numpy integers too
        for i, p in enumerate(ids):
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompts[{i}] has token id {bad[0]} outside the vocabulary [0, {vocab})")
    return texts, fill_empty(tokenizer, ids)


def fill_empty(tokenizer, ids: list[list[int]]) -> list[list[int]]:
    """An empty prompt starts from the BOS token."""
    bos = tokenizer.bos_token_id
    for i, p in enumerate(ids):
        if not p:
            if bos is None:
                raise ValueError(f"prompts[{i}] is empty and the tokenizer has no BOS token to start from")
            p.append(bos)
    return ids


def check_sampling_params(ids: list[list[int]], sampling_params, vocab_size: int, max_model_len: int, max_num_seqs: int) -> list[SamplingParams]:
    """One SamplingParams per prompt, checked against the vocabulary, max_model_len and
    max_num_seqs. Raises TypeError / ValueError naming the index and the allowed range."""
    if sampling_params is None:
        params = [SamplingParams()] * len(ids)
    elif isinstance(sampling_params, SamplingParams):
        params = [sampling_params] * len(ids)
    elif isinstance(sampling_params, (list, tuple)):
        if len(sampling_params) != len(ids):
            raise ValueError(f"sampling_params has {len(sampling_params)} entries for {len(ids)} prompts: give one or one per prompt")
        for i, p in enumerate(sampling_params):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}")
        params = list(sampling_params)
    else:
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got {type(sampling_params).__name__}")
    # A prompt may fill max_model_len: its one sampled token comes from the last position's logits
    # and is never fed back, so it needs no position or KV slot past max_model_len (vLLM v0's rule;
    # what scoring a full context through prompt_logprobs needs, lm-evaluation-harness #2880).
    limit = max_model_len
    for i, p in enumerate(ids):
        if len(p) > limit:
            raise ValueError(
                f"prompts[{i}] has {len(p)} tokens; the prompt must fit max_model_len={limit} "
                f"(allowed prompt length: 1 to {limit} tokens)"
            )
    # Validate every distinct SamplingParams again (fields may have been changed after it was built)
    # and use a frozen copy from here on, so nothing fails or changes once requests are queued.
    checked: dict[int, SamplingParams] = {}
    single = not isinstance(sampling_params, (list, tuple))
    for i, sp in enumerate(params):
        if id(sp) in checked:
            continue
        where = "sampling_params" if single else f"sampling_params[{i}]"
        try:
            copy = sp.clone()
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{where}: {exc}") from None
        if copy.n > max_num_seqs:
            raise ValueError(f"{where}.n must be at most max_num_seqs={max_num_seqs}, got {copy.n}")
        for name, token_ids in (
            ("stop_token_ids", copy.stop_token_ids),
            ("logit_bias", copy.logit_bias or ()),
            ("allowed_token_ids", copy.allowed_token_ids or ()),
        ):
            bad = [t for t in token_ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{where}.{name} has token id {bad[0]} outside the vocabulary [0, {vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(copy, name)
            if k is not None and k > vocab_size:
                raise ValueError(f"{where}.{name} must be in [0, {vocab_size}] (the vocabulary size), got {k}")
        checked[id(sp)] = copy
    return [checked[id(sp)] for sp in params]
