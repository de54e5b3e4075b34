"""Sequence and token classification (and reward) models of the decoder families: transformers'
``*ForSequenceClassification`` and ``*ForTokenClassification`` (Llama, Mistral, Qwen2, Qwen3,
Gemma): the family's decoder stack, and instead of ``lm_head`` a ``score`` layer (Linear hidden ->
num_labels; no bias for sequence classification, a bias for token classification unless
config.json ``token_classification_bias`` is false) applied to the pooled final hidden state (a
token classifier pools ALL: every token's row, ``LLM.reward`` / ``encode(pooling_task="token_classify")``).

    token ids [T] -> the decoder stack (model/llama.py, model/gemma.py) -> rows -> norm  [R, hidden]
                  -> pooled per sequence (worker/pooler.py: LAST for transformers' classifiers)
                  -> score                                                       [n, num_labels]

transformers applies ``score`` to every position and picks each sequence's last non-padding row;
the head is linear, so pooling first gives the same logits.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from pagedgen.config import ModelConfig
from pagedgen.distributed.group import PPGroup, TPGroup
from pagedgen.layers.embedding import ParallelLMHead
from pagedgen.model.gemma import GemmaForCausalLM
from pagedgen.model.llama import LlamaForCausalLM

#: *ForSequenceClassification -> the *ForCausalLM whose decoder stack (and flags) it shares
CAUSAL_OF = {
    "LlamaForSequenceClassification": "LlamaForCausalLM",
    "MistralForSequenceClassification": "MistralForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
    "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
    "GemmaForSequenceClassification": "GemmaForCausalLM",
}
CAUSAL_OF.update({name.replace("Sequence", "Token"): causal for name, causal in CAUSAL_OF.items()})


def _with_score_head(causal_cls: type) -> type:
    class ForSequenceClassification(causal_cls):
        lm_head_name = "score"
        required_config_fields = causal_cls.required_config_fields

        def __init__(self, hf_config, config: ModelConfig, tp: Optional[TPGroup] = None, pp: Optional[PPGroup] = None) -> None:
            if tp is not None and tp.size > 1 or pp is not None and pp.size > 1:
                raise ValueError(f"{config.architecture} runs in one process only (tensor_parallel_size=pipeline_parallel_size=1)")
            # the family picks its flags (Qwen2's q/k/v biases...) from the causal architecture's name
            super().__init__(hf_config, replace(config, architecture=CAUSAL_OF[config.architecture]), tp, pp)
            self.config = replace(self.config, architecture=config.architecture)
            del self.lm_head
            bias = config.architecture.endswith("ForTokenClassification") and getattr(hf_config, "token_classification_bias", True)
            self.score = ParallelLMHead(int(hf_config.num_labels), config.hidden_size, bias=bool(bias))  # [num_labels, hidden] (+ [num_labels])

    ForSequenceClassification.__name__ = ForSequenceClassification.__qualname__ = causal_cls.__name__.replace("ForCausalLM", "ForSequenceClassification")
    return ForSequenceClassification


LlamaForSequenceClassification = _with_score_head(LlamaForCausalLM)
GemmaForSequenceClassification = _with_score_head(GemmaForCausalLM)
