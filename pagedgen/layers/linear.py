"""Linear layers (vLLM's names: replicated, column- and row-parallel, merged, QKV): their weights,
layouts and loading; the matmul itself is ``pagedgen.layers.matmul.linear``.

A model never calls ``F.linear`` or ``@`` itself: its projections are the classes below and its
lm_head is ``ParallelLMHead`` (``pagedgen.layers.embedding``), all of which call
``pagedgen.layers.matmul.linear``. So a change to how matmuls run — fixed-size row blocks for batch
invariance, prepacked weights, a quantised kernel — is a change to that one function (matmul/dispatch.py).

The classes carry vLLM's names (``vllm/model_executor/layers/linear.py``) and are where the
tensor-parallel split goes (Megatron-LM): given a ``TPGroup`` of size > 1, a column-parallel linear
holds its rank's slice of the output features (a fused one the rank's slice of each part: its q
heads, its k and v heads, its gate and its up rows), a row-parallel one its slice of the input
features, followed by an all-reduce and then the bias. Without a group (or size 1) each holds the
whole matrix and runs exactly as before: no communicator, no extra copy. The sharded loader
(``sharded_weight_loader``) checks the global checkpoint shape, reads only the rank's rows or
columns (``CheckpointSlice``: safetensors' ``get_slice``), then rearranges the layout.

Weights are loaded per parameter (nano-vllm ``layers/linear.py``): ``param.weight_loader(param,
loaded, shard_id)`` copies one checkpoint tensor into its place. Fused projections (q/k/v in one
matrix, gate/up in one matrix) take either their parts (``shard_id`` "q"/"k"/"v" or 0/1, as Llama
checkpoints store them) or the whole fused tensor (``shard_id=None``, as Phi-3 and GPT-2 store
them). Checkpoint layouts other than ``[out_features, in_features]``:

- ``"conv1d"``: GPT-2's ``Conv1D`` stores ``[in_features, out_features]``; transposed on load.
- ``"interleaved_qkv"``: GPT-NeoX stores q/k/v per head, ``[num_heads, 3, head_dim]`` along the
  output features; reordered on load to ``[q heads | k heads | v heads]``.

A weight loader given a ``meta`` tensor only checks the shape (``pagedgen.layers.loading``).
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import nn

from pagedgen.distributed.group import TPGroup, shard_size, tp_size
from pagedgen.layers.loading import check_shape, read
from pagedgen.layers.matmul import MatmulConfig, fp8_linear, int4_linear, int8_linear, linear
from pagedgen.layers.module import Module

ShardId = Union[str, int, None]
LAYOUTS = ("default", "conv1d", "interleaved_qkv")


def _param(*shape: int) -> nn.Parameter:
    # Uninitialised: the model is built on the meta device and materialised by the loader.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class LinearBase(Module):
    """``y = x W^T + b`` over ``[T, input_size]`` rows; W: [output_size, input_size] (model dtype, or
    int8 with ``weight_scale``/``input_scale``: W8A8, ``pagedgen.layers.quant``; or float8_e4m3fn with
    ``weight_scale``: W8A16, ``pagedgen.layers.quant_fp8``; or 4-bit codes packed in uint8 with
    ``weight_scale``/``weight_zero`` per group: W4A16, ``pagedgen.layers.quant_int4``).

    Args:
        input_size, output_size: features in and out.
        bias: whether the layer has a bias [output_size].
        output_shards: for fused layers, the parts along the output features, in order:
            ``{shard_id: size}``; their sizes sum to ``output_size``.
        layout: how the checkpoint stores the weight (see the module docstring).
    """

    matmul: Optional[MatmulConfig] = None  # set by prepare_matmuls
    weight_block_k = 0  # FP8 with block-wise scales: the input features of one scale block (layers/quant_fp8.py)
    int4_group = 0  # int4 W4A16: the input features of one group (layers/quant_int4.py; weight_zero is then set)
    lora = None  # a pagedgen.lora.layers.LoRALayer when LoRA is on (its add_delta adds each row's adapter delta)

    def __init__(self, input_size: int, output_size: int, bias: bool = False, output_shards: Optional[dict] = None, layout: str = "default",
                 tp: Optional[TPGroup] = None, split: Optional[str] = None) -> None:
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.tp = tp if tp_size(tp) > 1 else None  # None: one rank holds the whole matrix (today's path)
        self.tp_split = split if self.tp is not None else None
        self.global_output_shards: dict = dict(output_shards or {})  # global sizes (the checkpoint's)
        self.global_output_size = output_size
        if self.tp_split == "out":  # column-parallel: each part of the output features split across ranks
            output_shards = {k: shard_size(v, tp, f"the {k!r} part of a fused projection") for k, v in self.global_output_shards.items()}
            output_size = shard_size(output_size, tp, "the output features of a column-parallel linear")
        elif self.tp_split == "in":  # row-parallel: input features split across ranks
            input_size = shard_size(input_size, tp, "the input features of a row-parallel linear")
        self.input_size, self.output_size, self.layout = input_size, output_size, layout  # per rank
        self.output_shards: dict = dict(output_shards or {})
        self.weight = _param(output_size, input_size)
        self.bias = _param(output_size) if bias else None
        self.register_parameter("weight_scale", None)  # [output_size] float32 when the weight is int8 (layers/quant.py)
        self.register_parameter("input_scale", None)  # [1] float32: a static activation scale (int8 weights only)
        self.register_parameter("weight_zero", None)  # int4: [ceil(out / 16), in / int4_group, 16] uint8 zero points
        for p in (self.weight, self.bias):
            if p is not None:
                p.weight_loader = self.weight_loader if self.tp is None else self.sharded_weight_loader
                p.shard_ids = tuple(self.output_shards)  # the parts a checkpoint may give separately

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, input_size] -> [T, output_size]
        y = self._matmul(x, self.bias)
        if self.lora is not None:
            self.lora.add_delta(x, y)
        return y

    def _matmul(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """x [T, input_size] @ W^T + bias -> [T, output_size]: the float GEMM, or W8A8 for int8 weights, W8A16 for FP8 and int4 ones."""
        if self.int4_group:  # int4 W4A16 (layers/quant_int4.py)
            return int4_linear(x, self.weight, self.weight_scale, self.weight_zero, self.int4_group, bias, self.output_size)
        if self.weight_scale is not None and self.weight.dtype == torch.float8_e4m3fn:  # FP8 W8A16 (layers/quant_fp8.py)
            return fp8_linear(x, self.weight, self.weight_scale, bias, self.matmul, self.weight_block_k)
        if self.weight_scale is not None:
            return int8_linear(x, self.weight, self.weight_scale, self.input_scale, bias, self.output_size, self.matmul)
        return linear(x, self.weight, bias, self.matmul, self.output_size)

    def _shard_slice(self, shard_id: ShardId) -> tuple[int, int]:
        """(offset, size) of a part along the output features; the whole for None."""
        if shard_id is None:
            return 0, self.output_size
        if shard_id not in self.output_shards:
            raise KeyError(f"unknown shard {shard_id!r} (this layer has {list(self.output_shards)})")
        offset = 0
        for sid, size in self.output_shards.items():
            if sid == shard_id:
                return offset, size
            offset += size
        raise AssertionError("unreachable")

    def _to_param_layout(self, loaded: torch.Tensor, is_weight: bool) -> torch.Tensor:
        """The checkpoint tensor rearranged to the parameter's [out, in] / [out] layout."""
        if self.layout == "conv1d" and is_weight:
            return loaded.t()
        if self.layout == "interleaved_qkv":
            heads = loaded.shape[0] // (3 * self.head_size)
            # [heads, 3, head_size, ...] -> [3, heads, head_size, ...]: q heads, then k, then v
            return loaded.reshape(heads, 3, self.head_size, -1).transpose(0, 1).reshape(loaded.shape)
        return loaded

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        """Copy the checkpoint tensor ``loaded`` (the part ``shard_id``, or all) into ``param``,
        converting to its dtype in the same pass. Raises WeightShapeError on a shape mismatch."""
        is_weight = param is self.weight
        offset, size = self._shard_slice(shard_id)
        dst = param.narrow(0, offset, size)
        expected = tuple(dst.shape)
        if self.layout == "conv1d" and is_weight:
            expected = expected[::-1]
        if check_shape(loaded, expected):  # False for a meta tensor: the dry run checks the shape only
            with torch.no_grad():
                dst.copy_(self._to_param_layout(read(loaded), is_weight))


    def sharded_weight_loader(self, param: nn.Parameter, loaded, shard_id: ShardId = None) -> None:
        """The tensor-parallel loader: checks ``loaded`` against the global shape, then reads only
        this rank's shard (``loaded`` may be a ``CheckpointSlice``), rearranges its layout and
        copies it. Column-parallel: each part's rows ``[rank * part / tp, + part / tp)`` into the
        local part; row-parallel: the input features ``[rank * in / tp, + in / tp)``; a
        row-parallel bias whole (added once, after the all-reduce)."""
        is_weight, conv = param is self.weight, self.layout == "conv1d" and param is self.weight
        rank = self.tp.rank
        if self.tp_split == "in":
            if not is_weight:
                if check_shape(loaded, (self.output_size,)):
                    with torch.no_grad():
                        param.copy_(read(loaded))
                return
            n = self.input_size
            expected = (self.output_size, n * self.tp.size)
            if check_shape(loaded, expected[::-1] if conv else expected):
                with torch.no_grad():
                    param.copy_(self._to_param_layout(read(loaded.narrow(0 if conv else 1, rank * n, n)), True))
            return
        out_dim = 1 if conv else 0
        if shard_id is None:
            size = self.global_output_size
        else:
            self._shard_slice(shard_id)  # KeyError for an unknown part
            size = self.global_output_shards[shard_id]
        expected = (size, self.input_size) if is_weight else (size,)
        if not check_shape(loaded, expected[::-1] if conv else expected):
            return
        with torch.no_grad():
            if self.layout == "interleaved_qkv":  # a rank's heads are contiguous in [heads, 3, D]
                rows = self.output_size
                param.copy_(self._to_param_layout(read(loaded.narrow(0, rank * rows, rows)), is_weight))
                return
            parts = [shard_id] if shard_id is not None else (list(self.output_shards) or [None])
            g_off = 0
            for sid in parts:
                l_off, l_size = self._shard_slice(sid)
                src = loaded.narrow(out_dim, g_off + rank * l_size, l_size)
                param.narrow(0, l_off, l_size).copy_(self._to_param_layout(read(src), is_weight))
                if shard_id is None and sid is not None:
                    g_off += self.global_output_shards[sid]


class ReplicatedLinear(LinearBase):
    """A linear layer every tensor-parallel rank holds whole (small projections, e.g. OPT's
    ``project_in``/``project_out``)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, layout: str = "default") -> None:
        super().__init__(input_size, output_size, bias, layout=layout)


class ColumnParallelLinear(LinearBase):
    """A linear layer whose output features a tensor-parallel split divides across ranks (the
    first matrix of an MLP, e.g. GPT-2's ``c_fc``): rank r holds rows ``[r * out / tp, + out / tp)``
    of W and b, and its output is its slice of the features (no communication)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, layout: str = "default", tp: Optional[TPGroup] = None) -> None:
        super().__init__(input_size, output_size, bias, layout=layout, tp=tp, split="out")


class RowParallelLinear(LinearBase):
    """A linear layer whose input features a tensor-parallel split divides across ranks, its
    partial outputs summed by an all-reduce (``o_proj``, ``down_proj``): rank r holds columns
    ``[r * in / tp, + in / tp)`` of W; the bias is added once, after the all-reduce."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, layout: str = "default", tp: Optional[TPGroup] = None) -> None:
        super().__init__(input_size, output_size, bias, layout=layout, tp=tp, split="in")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, input_size / tp] -> [T, output_size]
        if self.tp is None:
            return super().forward(x)
        partial = self._matmul(x, None)  # [T, out], this rank's input features
        if self.lora is not None:  # this rank's share of the delta: its columns of A (the all-reduce sums the shrink)
            self.lora.add_delta(x, partial)
        y = self.tp.comm.all_reduce(partial)  # [T, out], summed over ranks
        return y if self.bias is None else y.add_(self.bias)


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel projections of the same input in one matmul (gate and up of a gated
    MLP): output ``[T, sum(output_sizes)]``, part i at its offset; checkpoint shard ids 0, 1, ..."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False, layout: str = "default", tp: Optional[TPGroup] = None) -> None:
        super().__init__(input_size, sum(output_sizes), bias, dict(enumerate(output_sizes)), layout, tp, "out")


class QKVParallelLinear(LinearBase):
    """The query, key and value projections in one matmul: output ``[T, (num_heads + 2 *
    num_kv_heads) * head_size]`` = [q heads | k heads | v heads]; checkpoint shard ids "q", "k", "v".

    Args:
        hidden_size: input features.
        head_size: features of one head.
        num_heads, num_kv_heads: query heads and key/value heads (grouped-query attention).
        bias: whether q, k and v have biases.
        layout: "default" / "conv1d" (GPT-2) / "interleaved_qkv" (GPT-NeoX, needs num_kv_heads ==
            num_heads).
    """

    def __init__(self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int, bias: bool = False, layout: str = "default",
                 tp: Optional[TPGroup] = None) -> None:
        if layout == "interleaved_qkv" and num_kv_heads != num_heads:
            raise ValueError("the interleaved q/k/v layout needs num_kv_heads == num_heads")
        q, kv = num_heads * head_size, num_kv_heads * head_size
        shard_size(num_heads, tp, "num_attention_heads")
        shard_size(num_kv_heads, tp, "num_key_value_heads")
        self.head_size = head_size
        self.num_heads, self.num_kv_heads = num_heads // tp_size(tp), num_kv_heads // tp_size(tp)  # per rank
        super().__init__(hidden_size, q + 2 * kv, bias, {"q": q, "k": kv, "v": kv}, layout, tp, "out")

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, (H + 2 Hkv) D] -> q [T, H, D], k [T, Hkv, D], v [T, Hkv, D], views into ``qkv``
        (H, Hkv: this rank's heads)."""
        T, D = qkv.shape[0], self.head_size
        q_end, k_end = self.num_heads * D, (self.num_heads + self.num_kv_heads) * D
        return qkv[:, :q_end].view(T, -1, D), qkv[:, q_end:k_end].view(T, -1, D), qkv[:, k_end:].view(T, -1, D)
