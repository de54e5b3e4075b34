"""The driver's checks of a draft model (method ``"draft_model"``), before any weights load.

``check_speculative_model`` reads the draft's config.json and checks it against the target's (the
same vocabulary size, positions up to ``max_model_len``, no sliding window);
``check_draft_tokenizer`` compares the draft's tokenizer with the target's. Errors of reading the
draft checkpoint are raised again naming ``speculative_config['model']`` (``naming_the_draft``), so
that a broken draft is not mistaken for a broken target. The draft model itself, its KV cache and
its proposals, lives on the worker side (``draft_model.py``).
"""
from __future__ import annotations

import contextlib
import glob
import os

import torch

from pagedgen.model import loader
from pagedgen.spec_decode.config import SpeculativeConfig, check_draft_vocab


def check_speculative_model(spec: SpeculativeConfig, model_config, max_model_len: int):
    """The checks of a speculative config that need the target's config, before any weights are
    loaded: for method "draft_model" the draft's config.json (the same vocab_size, positions up to
    ``max_model_len``, no sliding window; ValueError naming the field). Returns the draft's
    (hf_config, ModelConfig) in the target's dtype, or None for "ngram"."""
    if spec.method != "draft_model":
        return None
    with naming_the_draft(spec.model):
        draft_hf, draft_config = draft_model_config(spec.model, model_config.dtype)
    check_draft(draft_config, model_config, spec.model, max_model_len)
    return draft_hf, draft_config


@contextlib.contextmanager
def naming_the_draft(draft_path: str):
    """Errors of reading the draft checkpoint (config.json, tokenizer files, weights: OSError and
    ValueError, e.g. ``CheckpointError``) are raised again naming ``speculative_config['model']``,
    so that a broken draft is not mistaken for a broken target. The same class where it takes one
    message, else ValueError / OSError; the original is the ``__cause__``."""
    try:
        yield
    except (OSError, ValueError) as exc:
        if str(exc).startswith("LLM speculative_config"):
            raise
        message = f"LLM speculative_config['model'] {draft_path!r} (the draft model): {exc}"
        try:
            renamed = type(exc)(message)
        except Exception:  # a class whose constructor takes other arguments (CheckpointError: path, why)
            renamed = ValueError(message) if isinstance(exc, ValueError) else OSError(message)
        raise renamed from exc


def check_draft(draft_config, target_config, draft_path: str, max_model_len: int) -> None:
    """The draft's config against the target's: the same vocabulary size (spec_decode/config.py's
    ``check_draft_vocab``), positions up to ``max_model_len``, no sliding window on either (the
    block manager releases blocks by the target's window). Raises ValueError naming the field."""
    check_draft_vocab(draft_config.vocab_size, target_config.vocab_size, draft_path)
    if draft_config.max_position_embeddings < max_model_len:
        raise ValueError(
            f"LLM speculative_config['model'] {draft_path!r} has max_position_embeddings "
            f"{draft_config.max_position_embeddings}, fewer than max_model_len={max_model_len}: the draft must "
            "reach every position of the target (pass a smaller max_model_len)"
        )
    for name, cfg in (("the target", target_config), (f"the draft {draft_path!r}", draft_config)):
        if cfg.sliding_window:
            raise ValueError(
                f"LLM speculative_config: method 'draft_model' needs models without a sliding window; {name} has "
                f"sliding_window={cfg.sliding_window}"
            )


def check_draft_tokenizer(draft_path: str, tokenizer) -> None:
    """When the draft's folder has tokenizer files, its vocabulary (token -> id) must equal the
    target tokenizer's: a ValueError otherwise. A folder without them is accepted (its vocab_size
    was checked)."""
    if not any(os.path.isfile(os.path.join(draft_path, f)) for f in loader.TOKENIZER_FILES) and not glob.glob(os.path.join(draft_path, "*.tiktoken")):
        return
    theirs = loader.load_tokenizer(draft_path).get_vocab()
    ours = tokenizer.get_vocab()
    if theirs != ours:
        differ = sorted(set(theirs.items()) ^ set(ours.items()), key=str)[:3]
        raise ValueError(
            f"LLM speculative_config['model'] {draft_path!r} has a tokenizer other than the target's "
            f"({len(theirs)} vs {len(ours)} tokens; e.g. {differ}): a draft model must share the target's tokenizer"
        )


def draft_model_config(path: str, dtype: torch.dtype):
    """(hf_config, ModelConfig) of the draft checkpoint at ``path`` in the target's ``dtype``."""
    hf_config = loader.load_hf_config(path)
    return hf_config, loader.model_config_from_hf(hf_config, dtype)

