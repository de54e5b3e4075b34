"""What every model family shares: the interface the engine calls, and how its checkpoint names map
onto its parameters.

The engine sees ``model.config`` (a ``ModelConfig``), ``model.device`` and
``model.forward(input_ids, positions, attn, kv_caches, logits_indices) -> logits``. A family
subclasses ``CausalLM``, builds its layers in ``__init__`` from ``(hf_config, config)`` under
``self.model`` and ``self.lm_head``, and says how checkpoint tensors find their parameters:

- parameter names mirror the checkpoint's (``model.layers.0.self_attn.o_proj.weight``), except
  fused projections: ``packed_modules_mapping`` maps a checkpoint module name to the fused module
  and its shard (``"q_proj": ("qkv_proj", "q")``), applied to one dotted component of the name;
- ``base_model_prefix``: the attribute holding the decoder stack; checkpoints saved from the bare
  model lack it (GPT-2's ``h.0...``, OPT's ``decoder...``) and get it prepended;
- ``ignored_weights``: regexes of checkpoint tensors that are not weights (buffers older
  transformers saved: causal masks, rotary ``inv_freq``).
"""
from __future__ import annotations

from dataclasses import replace
from typing import ClassVar, Optional

import torch

from pagedgen.config import ModelConfig
from pagedgen.distributed.group import PPGroup, TPGroup, tp_size
from pagedgen.layers.module import Module
from pagedgen.ops import AttentionMetadata

# key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]; a 1-byte cache adds
# key_scales, value_scales [num_blocks, block_size, num_kv_heads] (pagedgen/ops/kv_quant.py)
KVCache = tuple[torch.Tensor, ...]
#: what a pipeline stage hands the next: (hidden [T, hidden],) or (hidden, residual) (model/stages.py)
IntermediateTensors = tuple[torch.Tensor, ...]


def layer_sliding_windows(hf_config, num_layers: int) -> list[int]:
    """Per layer, the sliding window in tokens (0: full attention), as transformers applies it:
    per-layer ``layer_types`` (Qwen2/Qwen3: ``"sliding_attention"`` layers use ``sliding_window``),
    else ``sliding_window`` for every layer (Mistral, Phi-3)."""
    window = getattr(hf_config, "sliding_window", None) or 0
    if getattr(hf_config, "use_sliding_window", True) is False or window >= hf_config.max_position_embeddings:
        window = 0  # a window as long as the context is full attention
    types = getattr(hf_config, "layer_types", None)
    if types is not None and window:
        return [window if t == "sliding_attention" else 0 for t in types[:num_layers]]
    return [window] * num_layers


class CausalLM(Module):
    """Base of the model families (a decoder-only causal LM over the paged KV cache).

    Args:
        hf_config: the transformers config of the checkpoint (the family's own fields).
        config: the engine's view of it (shape of the KV cache, dtype).
        tp: this rank's tensor-parallel group (None: one rank holds the whole model); the layers
            get it in their constructors, and ``self.config`` then holds the rank's heads.
        pp: this rank's pipeline stage (None: one stage); the family builds only the stage's
            modules (model/stages.py), and ``self.config.num_layers`` is then the stage's count
            (the KV cache it allocates).

    Subclasses set the decoder stack as the attribute named ``base_model_prefix`` (``self.model``,
    GPT-2's ``self.transformer``...; ``forward(input_ids, positions, attn, kv_caches,
    logits_indices) -> [S, hidden]``, the final hidden rows of the sampled tokens) and the head as
    the one named ``lm_head_name`` (a ``ParallelLMHead``); ``embed_tokens_name``: the token
    embedding's module name, whose checkpoint tensor a tied head loads on a last pipeline stage
    that does not hold the embedding. Built on the
    meta device by the loader, which then allocates and fills the parameters
    (``pagedgen.model.weights.load_model``).
    """

    packed_modules_mapping: ClassVar[dict] = {}
    base_model_prefix: ClassVar[str] = "model"
    lm_head_name: ClassVar[str] = "lm_head"
    embed_tokens_name: ClassVar[str] = "model.embed_tokens"
    ignored_weights: ClassVar[tuple[str, ...]] = ()
    #: config.json fields the family needs beyond ``loader.REQUIRED_CONFIG_FIELDS``
    required_config_fields: ClassVar[tuple[str, ...]] = ()
    #: config.json fields that describe the weight shapes (named in shape-mismatch errors)
    shape_fields: ClassVar[tuple[str, ...]] = ("hidden_size", "num_attention_heads", "vocab_size")

    def __init__(self, hf_config, config: ModelConfig, tp: Optional[TPGroup] = None, pp: Optional[PPGroup] = None) -> None:
        super().__init__()
        # a tensor-parallel rank's config holds its own heads, a pipeline stage's its own layers (the KV cache it allocates)
        n = tp_size(tp)
        local = config if n == 1 else replace(config, num_heads=config.num_heads // n, num_kv_heads=config.num_kv_heads // n)
        self.config = local if pp is None else replace(local, num_layers=pp.num_layers)
        self.tp = tp
        self.pp = pp

    @classmethod
    def check_config(cls, hf_config) -> None:
        """Raise ValueError naming a config.json field whose value this family cannot honour.
        Called before the model is built; the default accepts everything."""

    @property
    def device(self) -> torch.device:
        for p in self.parameters():  # every stage holds some (the head is on the last one only)
            return p.device
        return torch.device("cpu")

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        attn: AttentionMetadata,
        kv_caches: list[KVCache],  # one per layer of this stage
        logits_indices: torch.Tensor,  # [S] int64, rows of the tokens whose next token is wanted
        intermediate: Optional[IntermediateTensors] = None,  # from the previous pipeline stage
        hidden_only: bool = False,
    ):
        """Logits [S, vocab] (model dtype; see ``ParallelLMHead``) for the tokens at
        ``logits_indices``; on a pipeline stage other than the last, the activations for the next
        stage instead (``IntermediateTensors``, each [T, hidden]). ``intermediate``: what the
        previous stage sent (None on the first stage, which embeds ``input_ids``).
        ``hidden_only``: the final hidden rows [S, hidden] instead of the logits, for the caller to
        run ``compute_logits`` over them in parts (prompt logprobs: sample/logprobs.py)."""
        hidden = getattr(self, self.base_model_prefix)(input_ids, positions, attn, kv_caches, logits_indices, intermediate)  # [S, hidden]
        if self.pp is not None and not self.pp.is_last or hidden_only:
            return hidden  # IntermediateTensors for the next stage, or the rows for compute_logits
        return self.compute_logits(hidden)  # [S, vocab] model dtype

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The lm_head: final hidden rows [S, hidden] -> logits [S, vocab], model dtype (gathered
        on every tensor-parallel rank: every rank calls it with the same rows)."""
        return getattr(self, self.lm_head_name)(hidden)

    @torch.inference_mode()
    def pooled_hidden(self, input_ids, positions, attn: AttentionMetadata, kv_caches: list[KVCache], rows: torch.Tensor) -> torch.Tensor:
        """The final, normalised hidden states [R, hidden] (model dtype) at ``rows`` (int64 [R]):
        what a pooling model pools (worker/pooler.py). One stage only (no pipeline)."""
        return getattr(self, self.base_model_prefix)(input_ids, positions, attn, kv_caches, rows, None)

    @torch.inference_mode()
    def compute_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head over ``hidden`` [m, hidden]: [m, vocab] logits, or [m, num_labels] for a
        classification model's ``score`` (model dtype)."""
        return getattr(self, self.lm_head_name)(hidden)
