"""Encoder models for embeddings: BERT and XLM-RoBERTa (transformers' ``modeling_bert``,
``modeling_xlm_roberta``: ``BertModel``, ``XLMRobertaModel``; the shapes of all-MiniLM, bge, e5).

    token ids [T], positions [T]
      -> word_embeddings(ids) + position_embeddings(positions (+ padding_idx + 1: XLM-R))
         + token_type_embeddings(types: 0, 1 for a pair's second segment) -> LayerNorm  [T, hidden]
      -> layer x N (post-norm):
           x = LayerNorm(x + output.dense(attention(query, key, value)))   bidirectional, per sequence
           x = LayerNorm(x + output.dense(act(intermediate.dense(x))))
      -> rows                                                                  [R, hidden]

No KV cache: attention is bidirectional within each sequence of the step (``query_start_loc``),
so a prompt is computed whole in one step (the scheduler never chunks it: ``PoolingSpec.whole_prompt``)
and never uses the prefix cache. Where the CPU kernel is built, attention is one
``ops.varlen_attention`` call a layer over the packed rows (q, k, v read as views of the fused qkv
output: no padding, no gathers). Elsewhere (a GPU, no extension) it runs batched by length bucket
(``AttentionPlan``): each sequence padded to its own length rounded up to ``BUCKET`` rows, its
padding keys masked, the sequences of one bucket in one ``scaled_dot_product_attention`` call. Either
way a sequence's result does not depend on the other sequences of the step (batch-invariant: the
kernel's tiles and a bucket's padded length depend on the sequence's own length only, and each
(sequence, head) is computed on its own). Token type 0
everywhere but in a cross-encoder's pair (``LLM.score``: type 1 from the second segment on,
``PoolingSpec.token_type_start``). The BERT pooler layer (``pooler.dense``) is used only by
``BertForSequenceClassification``'s head (sentence-transformers' embeddings do not use it).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from pagedgen.config import ModelConfig
from pagedgen.distributed.group import PPGroup, TPGroup
from pagedgen.layers.activation import get_act_fn
from pagedgen.layers.embedding import PositionEmbedding, VocabParallelEmbedding
from pagedgen.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedgen.layers.module import Module
from pagedgen.layers.norm import LayerNorm
from pagedgen.model.base import CausalLM
from pagedgen import ops
from pagedgen.ops import AttentionMetadata


class _Embeddings(Module):
    def __init__(self, hf_config, position_offset: int) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        self.word_embeddings = VocabParallelEmbedding(hf_config.vocab_size, hidden)
        self.position_embeddings = PositionEmbedding(hf_config.max_position_embeddings, hidden)
        self.token_type_embeddings = PositionEmbedding(hf_config.type_vocab_size, hidden)  # a table of rows, indexed by type
        self.LayerNorm = LayerNorm(hidden, hf_config.layer_norm_eps)
        self.position_offset = position_offset

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_types: Optional[torch.Tensor] = None) -> torch.Tensor:
        pos = positions + self.position_offset if self.position_offset else positions
        types = self.token_type_embeddings.weight[0] if token_types is None else self.token_type_embeddings(token_types)  # [hidden] / [T, hidden]
        x = self.word_embeddings(input_ids) + types + self.position_embeddings(pos)
        return self.LayerNorm(x)  # [T, hidden]


BUCKET = 16  # a sequence's attention is padded to its length rounded up to this many rows


class AttentionPlan:
    """How one step's sequences (``query_start_loc``: their rows' start offsets, [n + 1] int32) are
    attended (``attend``). With the kernel (``kernel``: by default where
    ``ops.has_kernel("varlen_attention")`` for the rows' device): ``cu_seqlens`` is
    ``query_start_loc`` and ``groups`` is empty. Otherwise ``cu_seqlens`` is None and ``groups`` the
    length buckets: per bucket (padded length P, a multiple of ``BUCKET``), ``index`` [B, P] int64
    (each padded row's source row in [T], T = a zero row past the end), ``mask`` [B, 1, 1, P] bool
    (True: a real key), ``real`` [n_rows] int64 (the real rows' places in the flattened [B * P]) and
    ``rows`` [n_rows] int64 (those rows in [T], in the same order)."""

    def __init__(self, query_start_loc: torch.Tensor, kernel: Optional[bool] = None) -> None:
        if kernel is None:
            kernel = ops.has_kernel("varlen_attention", query_start_loc.device.type)
        self.groups = []
        self.cu_seqlens = query_start_loc if kernel else None
        if kernel:
            return
        bounds = query_start_loc.tolist()  # one copy back a step
        total = bounds[-1]
        buckets: dict[int, list[tuple[int, int]]] = {}
        for a, b in zip(bounds[:-1], bounds[1:]):
            buckets.setdefault(-(-(b - a) // BUCKET) * BUCKET, []).append((a, b))
        for padded, spans in sorted(buckets.items()):
            index = torch.full((len(spans), padded), total, dtype=torch.int64)  # [B, P]
            for j, (a, b) in enumerate(spans):
                index[j, : b - a] = torch.arange(a, b)
            real = index < total  # [B, P]
            flat = real.view(-1).nonzero().view(-1)  # [n_rows]
            self.groups.append((index.view(-1), real[:, None, None, :], flat, index.view(-1)[flat]))

    def attend(self, qkv: torch.Tensor, head_size: int) -> torch.Tensor:
        """Each sequence's rows attend to their own rows only: qkv [T, 3 H D] (q, k, v side by side,
        QKVParallelLinear.split's layout) -> [T, H D], scale 1 / sqrt(head_size) (SDPA's default)."""
        T, HD = qkv.shape[0], qkv.shape[1] // 3
        D = head_size
        H = HD // D
        if self.cu_seqlens is not None:  # the kernel: q, k, v as strided views [T, H, D], no copy
            q, k, v = qkv.view(T, 3, H, D).unbind(1)
            out = qkv.new_empty(T, H, D)
            ops.varlen_attention(out, q, k, v, self.cu_seqlens, D ** -0.5)
            return out.view(T, HD)
        qkv = torch.cat([qkv, qkv.new_zeros(1, 3 * HD)])  # [T + 1, 3 H D]: row T is the padding rows' source
        out = qkv.new_empty(T, HD)  # [T, H D]
        for index, mask, flat, rows in self.groups:  # one bucket
            B, P = mask.shape[0], mask.shape[-1]
            g = qkv.index_select(0, index).view(B, P, 3, H, -1)  # [B, P, 3, H, D]
            q, k, v = (g[:, :, i].transpose(1, 2) for i in range(3))  # [B, H, P, D]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(B * P, HD)  # [B P, H D]
            out.index_copy_(0, rows, o.index_select(0, flat))  # the real rows
        return out  # [T, H * D]


class _SelfAttention(Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        H, D = config.num_heads, config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, D, H, H, bias=True)

    def forward(self, x: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
        return plan.attend(self.qkv_proj(x), self.qkv_proj.head_size)  # [T, H D]


class _Output(Module):
    """``dense`` then ``LayerNorm(residual + dropout(dense(x)))`` (BertSelfOutput / BertOutput)."""

    def __init__(self, hf_config, inner: int) -> None:
        super().__init__()
        self.dense = RowParallelLinear(inner, hf_config.hidden_size, bias=True)
        self.LayerNorm = LayerNorm(hf_config.hidden_size, hf_config.layer_norm_eps)

    def forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        # post-LN: LayerNorm(dense(h) + residual), the add fused into the norm where its kernel runs
        # (x + y == y + x in float, so the sum is transformers' bits); the sum lands in `residual`
        # (the layer's input, not read again) and the norm in dense's output
        return self.LayerNorm(self.dense(h), residual)[0]


class _Attention(Module):
    def __init__(self, hf_config, config: ModelConfig) -> None:
        super().__init__()
        setattr(self, "self", _SelfAttention(config))  # the checkpoint's name: attention.self.query...
        self.output = _Output(hf_config, config.hidden_size)

    def forward(self, x: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
        return self.output(getattr(self, "self")(x, plan), x)


class _Intermediate(Module):
    def __init__(self, hf_config) -> None:
        super().__init__()
        self.dense = ColumnParallelLinear(hf_config.hidden_size, hf_config.intermediate_size, bias=True)
        self.act = get_act_fn(hf_config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class _Layer(Module):
    def __init__(self, hf_config, config: ModelConfig) -> None:
        super().__init__()
        self.attention = _Attention(hf_config, config)
        self.intermediate = _Intermediate(hf_config)
        self.output = _Output(hf_config, hf_config.intermediate_size)

    def forward(self, x: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
        x = self.attention(x, plan)
        return self.output(self.intermediate(x), x)


class _Encoder(Module):
    def __init__(self, hf_config, config: ModelConfig) -> None:
        super().__init__()
        self.layer = torch.nn.ModuleList(_Layer(hf_config, config) for _ in range(config.num_layers))


class _BertStack(Module):
    def __init__(self, hf_config, config: ModelConfig, position_offset: int) -> None:
        super().__init__()
        self.embeddings = _Embeddings(hf_config, position_offset)
        self.encoder = _Encoder(hf_config, config)

    def forward(self, input_ids, positions, attn: AttentionMetadata, rows: torch.Tensor, token_types=None) -> torch.Tensor:
        plan = AttentionPlan(attn.query_start_loc)  # [n + 1]: the sequences' rows
        x = self.embeddings(input_ids, positions, token_types)
        for layer in self.encoder.layer:
            x = layer(x, plan)
        return x[rows]  # [R, hidden]


class BertModel(CausalLM):
    """``BertModel`` (and ``XLMRobertaModel``, whose positions start after ``pad_token_id``):
    an encoder whose final hidden states are pooled (``LLM.embed``). Checkpoints with or without the
    ``bert.`` / ``roberta.`` prefix load."""

    is_encoder = True  # no KV cache; a prompt is computed whole in one step
    base_model_prefix = "bert"
    lm_head_name = "score"  # none: an embedding model
    packed_modules_mapping = {"query": ("qkv_proj", "q"), "key": ("qkv_proj", "k"), "value": ("qkv_proj", "v")}
    ignored_weights = (r"(^|\.)pooler\.dense\.", r"(^|\.)position_ids$", r"(^|\.)token_type_ids$")
    required_config_fields = ("intermediate_size", "type_vocab_size")
    shape_fields = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size", "max_position_embeddings", "type_vocab_size")

    @staticmethod
    def position_offset(hf_config) -> int:
        return 0

    @classmethod
    def usable_positions(cls, hf_config) -> int:
        """The longest prompt the position table allows (XLM-R's first pad_token_id + 1 rows are not positions)."""
        return hf_config.max_position_embeddings - cls.position_offset(hf_config)

    @classmethod
    def check_config(cls, hf_config) -> None:
        kind = getattr(hf_config, "position_embedding_type", "absolute")
        if kind != "absolute":
            raise ValueError(f"config.json position_embedding_type={kind!r} is not supported: only 'absolute'")
        if getattr(hf_config, "is_decoder", False):
            raise ValueError("config.json is_decoder=True (a causal BERT) is not supported: pagedgen's BERT is an encoder")

    def __init__(self, hf_config, config: ModelConfig, tp: Optional[TPGroup] = None, pp: Optional[PPGroup] = None) -> None:
        if tp is not None and tp.size > 1 or pp is not None and pp.size > 1:
            raise ValueError(f"{config.architecture} runs in one process only (tensor_parallel_size=pipeline_parallel_size=1)")
        super().__init__(hf_config, config, tp, pp)
        setattr(self, self.base_model_prefix, _BertStack(hf_config, config, self.position_offset(hf_config)))
        self.score = None

    @torch.inference_mode()
    def compute_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The classification head over pooled rows [m, hidden] -> [m, num_labels] (none for a bare
        encoder: ValueError; the pooling checks never call it then)."""
        head = getattr(self, self.lm_head_name)
        if head is None:
            raise ValueError(f"{self.config.architecture} has no classification head")
        return head(hidden)

    @torch.inference_mode()
    def pooled_hidden(self, input_ids, positions, attn: AttentionMetadata, kv_caches, rows: torch.Tensor,
                      token_types: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The final hidden rows [R, hidden] at ``rows``; ``token_types``: [T] int64 or None (all 0)."""
        return getattr(self, self.base_model_prefix)(input_ids, positions, attn, rows, token_types)  # [R, hidden]

    def forward(self, input_ids, positions, attn: AttentionMetadata, kv_caches, logits_indices, intermediate=None) -> torch.Tensor:
        """The final hidden rows at ``logits_indices`` [S, hidden]: an encoder has no language-model
        head (a pooling LLM never samples: engine/offline.py refuses generation); the GPU's profiling
        pass (worker/kv_profile.py) is what calls it, with the step shape it measures."""
        return self.pooled_hidden(input_ids, positions, attn, kv_caches, logits_indices)


class XLMRobertaModel(BertModel):
    """``XLMRobertaModel``: BERT's layers; position p reads row ``pad_token_id + 1 + p``."""

    base_model_prefix = "roberta"

    @staticmethod
    def position_offset(hf_config) -> int:
        return hf_config.pad_token_id + 1


class _ClassificationHead(Module):
    """RoBERTa's classification head over the pooled (CLS) row: ``out_proj(tanh(dense(x)))``."""

    def __init__(self, hf_config) -> None:
        super().__init__()
        self.dense = ColumnParallelLinear(hf_config.hidden_size, hf_config.hidden_size, bias=True)
        self.out_proj = ColumnParallelLinear(hf_config.hidden_size, int(hf_config.num_labels), bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(x)))  # [m, num_labels]


class XLMRobertaForSequenceClassification(XLMRobertaModel):
    """``XLMRobertaForSequenceClassification`` (cross-encoders and rerankers of bge-reranker's
    shape): the encoder, CLS pooling, then ``classifier`` (dense, tanh, out_proj). ``LLM.score``
    reads each pair as one prompt (the tokenizer's pair encoding, token type 0 throughout)."""

    lm_head_name = "classifier"

    def __init__(self, hf_config, config: ModelConfig, tp: Optional[TPGroup] = None, pp: Optional[PPGroup] = None) -> None:
        super().__init__(hf_config, config, tp, pp)
        del self.score
        self.classifier = _ClassificationHead(hf_config)


class _Pooler(Module):
    """BERT's pooler: ``tanh(dense(x))`` over the CLS row."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense = ColumnParallelLinear(hidden, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(x))


class BertForSequenceClassification(BertModel):
    """``BertForSequenceClassification`` (cross-encoders of the ms-marco MiniLM shape): the encoder,
    CLS pooling, BERT's pooler (``bert.pooler.dense``, tanh), then ``classifier`` (Linear with a bias).
    ``LLM.score`` reads each pair as one prompt with token type 1 from its second segment on."""

    lm_head_name = "classifier"
    ignored_weights = (r"(^|\.)position_ids$", r"(^|\.)token_type_ids$")

    def __init__(self, hf_config, config: ModelConfig, tp: Optional[TPGroup] = None, pp: Optional[PPGroup] = None) -> None:
        super().__init__(hf_config, config, tp, pp)
        del self.score
        self.bert.pooler = _Pooler(hf_config.hidden_size)
        self.classifier = ColumnParallelLinear(hf_config.hidden_size, int(hf_config.num_labels), bias=True)

    @torch.inference_mode()
    def compute_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.bert.pooler(hidden))  # [m, num_labels]
