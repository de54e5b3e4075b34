"""The supported architectures: Hugging Face architecture name (config.json ``architectures``) ->
model class, in one table (vLLM's ``model_executor/models/registry.py``). Family modules are
imported only when used.
"""
from __future__ import annotations

import importlib
from typing import Optional

#: architecture -> (module in pagedgen.model, class, config.json model_type it is saved with)
_MODELS: dict[str, tuple[str, str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM", "llama"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM", "mistral"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM", "qwen2"),
    "Qwen3ForCausalLM": ("llama", "LlamaForCausalLM", "qwen3"),
    "Phi3ForCausalLM": ("llama", "LlamaForCausalLM", "phi3"),
    "GemmaForCausalLM": ("gemma", "GemmaForCausalLM", "gemma"),
    "GPT2LMHeadModel": ("gpt2", "GPT2LMHeadModel", "gpt2"),
    "OPTForCausalLM": ("opt", "OPTForCausalLM", "opt"),
    "GPTNeoXForCausalLM": ("gpt_neox", "GPTNeoXForCausalLM", "gpt_neox"),
    # pooling models (LLM(runner="pooling"): embed / classify / score / reward): a score head on the decoder stack
    "LlamaForSequenceClassification": ("classification", "LlamaForSequenceClassification", "llama"),
    "MistralForSequenceClassification": ("classification", "LlamaForSequenceClassification", "mistral"),
    "Qwen2ForSequenceClassification": ("classification", "LlamaForSequenceClassification", "qwen2"),
    "Qwen3ForSequenceClassification": ("classification", "LlamaForSequenceClassification", "qwen3"),
    "GemmaForSequenceClassification": ("classification", "GemmaForSequenceClassification", "gemma"),
    "LlamaForTokenClassification": ("classification", "LlamaForSequenceClassification", "llama"),
    "MistralForTokenClassification": ("classification", "LlamaForSequenceClassification", "mistral"),
    "Qwen2ForTokenClassification": ("classification", "LlamaForSequenceClassification", "qwen2"),
    "Qwen3ForTokenClassification": ("classification", "LlamaForSequenceClassification", "qwen3"),
    "GemmaForTokenClassification": ("classification", "GemmaForSequenceClassification", "gemma"),
    # encoders (embeddings; no KV cache): BERT and XLM-RoBERTa
    "BertModel": ("bert", "BertModel", "bert"),
    "XLMRobertaModel": ("bert", "XLMRobertaModel", "xlm-roberta"),
    "XLMRobertaForSequenceClassification": ("bert", "XLMRobertaForSequenceClassification", "xlm-roberta"),
    "BertForSequenceClassification": ("bert", "BertForSequenceClassification", "bert"),
}


def supported_architectures() -> list[str]:
    """The architecture names pagedgen can load."""
    return list(_MODELS)


def resolve_architecture(architectures, where: str = "config.json", model_type: Optional[str] = None) -> tuple[str, type]:
    """The first of ``architectures`` that is supported, and its model class.

    Raises:
        ValueError: none is supported (the error lists the supported ones), or ``model_type`` (when
            given) is not the one that architecture is saved with.
    """
    names = list(architectures or [])
    for name in names:
        if name in _MODELS:
            module, cls, expected_type = _MODELS[name]
            if model_type is not None and model_type != expected_type:
                raise ValueError(
                    f"{where}: architectures={names} needs model_type={expected_type!r}, got model_type={model_type!r}"
                )
            return name, getattr(importlib.import_module(f"pagedgen.model.{module}"), cls)
    raise ValueError(
        f"unsupported architecture {names if names else '(config.json has no architectures field)'} in {where}; "
        f"supported: {', '.join(_MODELS)}"
    )
