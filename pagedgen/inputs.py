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


def parse_prompt(prompt, name: str) -> tuple[Optional[str], Optional[list[int]]]:
    """One prompt: a str, a list of int token ids, ``{"prompt": str}`` or ``{"prompt_token_ids":
    [int, ...]}`` (vLLM's TextPrompt / TokensPrompt). Returns (text, None) or (None, token ids).
    Raises TypeError naming ``name`` (e.g. ``prompts[3]``)."""
    if isinstance(prompt, dict):
        keys = set(prompt)
        if keys == {"prompt"} and isinstance(prompt["prompt"], str):
            return prompt["prompt"], None
        if keys == {"prompt_token_ids"}:
            return None, token_id_list(prompt["prompt_token_ids"], f"{name}['prompt_token_ids']")
        raise TypeError(f"{name} must be {{'prompt': str}} or {{'prompt_token_ids': [int, ...]}}, got keys {sorted(keys)}")
    if isinstance(prompt, str):
        return prompt, None
    return None, token_id_list(prompt, name)


def token_id_list(p, name: str) -> list[int]:
    """``p`` as a list of Python ints (numpy integers too). Raises TypeError naming ``name``."""
    if not isinstance(p, (list, tuple)):
        raise TypeError(f"{name} must be a list of int token ids, got {type(p).__name__}")
    if all(type(t) is int for t in p):  # the common case, without the slower ABC checks below
        return list(p)
    for j, t in enumerate(p):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"{name}[{j}] must be an int token id, got {type(t).__name__} {t!r}")
    return [int(t) for t in p]


def check_token_ids(ids: list[int], vocab_size: int, name: str) -> None:
    if ids and 0 <= min(ids) and max(ids) < vocab_size:
        return
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{name} has token id {bad[0]} outside the vocabulary [0, {vocab_size})")


def check_prompt_length(ids: list[int], max_model_len: int, name: str) -> None:
    """The prompt must fit ``max_model_len``. It may fill it: its one sampled token comes from the
    last position's logits and is never fed back, so it needs no position or KV slot past
    max_model_len (vLLM v0's rule; what scoring a full context through prompt_logprobs needs,
    lm-evaluation-harness #2880)."""
    if len(ids) > max_model_len:
        raise ValueError(
            f"{name} has {len(ids)} tokens; the prompt must fit max_model_len={max_model_len} "
            f"(allowed prompt length: 1 to {max_model_len} tokens)"
        )


def tokenize_prompts(tokenizer, prompts, vocab_size: int) -> tuple[list[Optional[str]], list[list[int]]]:
    """Validate ``prompts`` (a str, or a list of prompts as ``parse_prompt`` takes them; bare str
    and bare token-id lists not mixed) and return (texts or None per prompt, token ids per prompt).
    Texts are tokenized in one batch. Raises TypeError / ValueError naming the prompt's index."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a str, a list of str or a list of token-id lists, got {type(prompts).__name__}")
    if not prompts:
        return [], []
    bare = [i for i, p in enumerate(prompts) if not isinstance(p, dict)]  # dicts say what they hold
    first = bare[0] if bare else 0
    first_is_text = isinstance(prompts[first], str)
    texts: list[Optional[str]] = []
    ids: list[Optional[list[int]]] = []
    for i, p in enumerate(prompts):
        if not isinstance(p, dict) and first_is_text != isinstance(p, str):
            if first_is_text:
                raise TypeError(f"prompts[{i}] is a {type(p).__name__}, but prompts[{first}] is a str: do not mix prompt types")
            raise TypeError(f"prompts[{i}] is a str, but prompts[{first}] is a token-id list: do not mix prompt types")
        text, token_ids = parse_prompt(p, f"prompts[{i}]")
        if token_ids is not None:
            check_token_ids(token_ids, vocab_size, f"prompts[{i}]")
        texts.append(text)
        ids.append(token_ids)
    to_encode = [t for t, x in zip(texts, ids) if x is None]
    if to_encode:
        encoded = iter(tokenizer(to_encode, add_special_tokens=True)["input_ids"])
        ids = [list(next(encoded)) if x is None else x for x in ids]
        for i, (text, token_ids) in enumerate(zip(texts, ids)):
            if text is not None:  # a tokenizer may hold ids past the model's vocabulary (added tokens)
                check_token_ids(token_ids, vocab_size, f"prompts[{i}] (as tokenized)")
    return texts, fill_empty(tokenizer, ids)


def tokenize_prompt(tokenizer, prompt, vocab_size: int, name: str) -> tuple[Optional[str], list[int]]:
    """``tokenize_prompts`` for one prompt, named ``name`` in errors."""
    text, ids = parse_prompt(prompt, name)
    if ids is None:
        ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
        check_token_ids(ids, vocab_size, f"{name} (as tokenized)")  # a tokenizer may hold ids past the model's vocabulary
    else:
        check_token_ids(ids, vocab_size, name)
    return text, fill_empty(tokenizer, [ids], [name])[0]


def fill_empty(tokenizer, ids: list[list[int]], names: Optional[list[str]] = None) -> list[list[int]]:
    """An empty prompt starts from the BOS token."""
    for i, p in enumerate(ids):
        if not p:
            bos = tokenizer.bos_token_id  # a property lookup of ~10 µs in transformers 5: only when needed
            if bos is None:
                raise ValueError(f"{names[i] if names else f'prompts[{i}]'} is empty and the tokenizer has no BOS token to start from")
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
    for i, p in enumerate(ids):
        check_prompt_length(p, max_model_len, f"prompts[{i}]")
    checked: dict[int, SamplingParams] = {}
    single = not isinstance(sampling_params, (list, tuple))
    for i, sp in enumerate(params):
        if id(sp) not in checked:
            checked[id(sp)] = checked_params(sp, "sampling_params" if single else f"sampling_params[{i}]", vocab_size, max_num_seqs)
    return [checked[id(sp)] for sp in params]


def checked_params(sp: SamplingParams, where: str, vocab_size: int, max_num_seqs: int) -> SamplingParams:
    """A validated, private copy of ``sp``: its fields are checked again (they may have been changed
    after it was built), then against the vocabulary and max_num_seqs, so nothing fails or changes
    once the request is queued. Errors start with ``where``."""
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
    return copy


def render_chats(tokenizer, messages, chat_template, add_generation_prompt: bool, continue_final_message: bool) -> list[str]:
    """The prompt text of each conversation of ``LLM.chat`` (see its docstring for the checks)."""
    if isinstance(messages, (list, tuple)) and messages and all(isinstance(m, dict) for m in messages):
        conversations = [messages]
    elif isinstance(messages, (list, tuple)) and all(isinstance(c, (list, tuple)) for c in messages):
        conversations = list(messages)
    else:
        raise TypeError("messages must be a conversation (a list of {'role', 'content'} dicts) or a list of conversations")
    if chat_template is not None and (not isinstance(chat_template, str) or not chat_template.strip()):
        raise ValueError(f"chat_template must be a non-empty Jinja template string, got {chat_template!r}")
    for i, conv in enumerate(conversations):
        if not conv:
            raise ValueError(f"conversation {i} is empty: it needs at least one message")
        for j, m in enumerate(conv):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"conversation {i}, message {j} must be a dict with str 'role' and 'content', got {m!r}")
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be True")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the tokenizer has no chat template: pass chat_template=... (a Jinja template string) to LLM.chat, "
            "or use LLM.generate with plain prompts"
        )
    import jinja2

    texts = []
    for i, conv in enumerate(conversations):
        try:
            texts.append(
                tokenizer.apply_chat_template(
                    list(conv),
                    chat_template=chat_template,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    tokenize=False,
                )
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"the chat template failed on conversation {i}: {exc}") from exc
    return texts
