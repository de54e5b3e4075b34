"""The layouts a weight is kept in for its GEMM, and ``prepare_matmuls``, which puts a loaded model's
weights into them: panels (``pack_panels``) for pagedgen's own GEMM, bf16 pairs (``pack_pairs``) for its
AVX512-BF16 and AMX GEMMs, oneDNN's blocked layout (``prepack``). Which layout a model gets is
``choice``'s (its docstring has the paths and why).
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pagedgen.layers.matmul.config import MatmulConfig

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
#: the batch size oneDNN packs the weights for (any M runs; measured no faster with 1 or 64)
PREPACK_ROWS = 16
#: output features per panel of a weight packed for pagedgen's own GEMM (csrc/cpu/linear.cpp)
PANEL = 16


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] weight -> [ceil(N / PANEL), K, PANEL] panels, same dtype: ``out[p, k, j] = weight[PANEL
    p + j, k]``, zeros past N. The layout ``ops.packed_linear`` reads: one panel row holds the k-th
    input feature's weights of PANEL consecutive outputs.

    Raises:
        TypeError: ``weight`` is not a tensor.
        ValueError: ``weight`` is not a 2-D float32, bfloat16 or float16 tensor.
    """
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"pack_panels needs a torch.Tensor weight, got {type(weight).__name__}")
    if weight.dim() != 2 or weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"pack_panels needs a 2-D float32, bfloat16 or float16 weight, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    padded = F.pad(weight.detach(), (0, 0, 0, -n % PANEL))  # [P * PANEL, K]
    return padded.view(-(-n // PANEL), PANEL, k).transpose(1, 2).contiguous()  # [P, K, PANEL]


def pack_pairs(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 weight -> [ceil(N / PANEL), ceil(K / 2), PANEL, 2] bf16 pairs: ``out[p, q, j, t] =
    weight[PANEL p + j, 2 q + t]``, zeros past N and past K. The layout ``ops.packed_linear_bf16``
    reads: one panel row [p, q] (64 bytes, one AVX-512 register) holds the input pair (2 q, 2 q + 1)'s
    weights of PANEL consecutive outputs, as vdpbf16ps multiplies them.

    Raises:
        TypeError: ``weight`` is not a tensor.
        ValueError: ``weight`` is not a 2-D bfloat16 tensor.
    """
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"pack_pairs needs a torch.Tensor weight, got {type(weight).__name__}")
    if weight.dim() != 2 or weight.dtype != torch.bfloat16:
        raise ValueError(f"pack_pairs needs a 2-D bfloat16 weight, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    padded = F.pad(weight.detach(), (0, k % 2, 0, -n % PANEL))  # [P * PANEL, 2 Q]
    return padded.view(-(-n // PANEL), PANEL, -(-k // 2), 2).transpose(1, 2).contiguous()  # [P, Q, PANEL, 2]


def pack_int8(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] int8 weight -> [ceil(N / PANEL), ceil(K / 2), PANEL, 2] int8 pairs: ``out[p, q, j, t] =
    weight[PANEL p + j, 2 q + t]``, zeros past N and K (``pack_pairs``' layout, in bytes). The layout
    ``ops.int8_linear`` reads: one panel row [p, q] (32 bytes) holds the input pair (2 q, 2 q + 1)'s
    weights of PANEL consecutive outputs, sign-extended to int16 for vpmaddwd.

    Raises:
        ValueError: ``weight`` is not a 2-D int8 tensor.
    """
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.dtype != torch.int8:
        raise ValueError(f"pack_int8 needs a 2-D int8 weight, got {getattr(weight, 'dtype', type(weight))} {tuple(getattr(weight, 'shape', ()))}")
    n, k = weight.shape
    padded = F.pad(weight.detach(), (0, k % 2, 0, -n % PANEL))  # [P * PANEL, 2 Q]
    return padded.view(-(-n // PANEL), PANEL, -(-k // 2), 2).transpose(1, 2).contiguous()  # [P, Q, PANEL, 2]


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float32 or bfloat16 weight -> the same matrix in oneDNN's blocked inner-product
    layout (an opaque ``is_mkldnn`` tensor of shape [N, K] and the same dtype and element size),
    for ``linear``. bf16 needs a CPU with oneDNN bf16 (``native_reduced_precision``).

    Raises:
        TypeError: ``weight`` is not a tensor.
        ValueError: ``weight`` is not a 2-D float32 or bfloat16 tensor with at least one element.
    """
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"prepack needs a torch.Tensor weight, got {type(weight).__name__}")
    if weight.dtype not in PACKABLE_DTYPES or weight.dim() != 2 or weight.numel() == 0:
        raise ValueError(f"prepack needs a non-empty 2-D float32 or bfloat16 weight, got {weight.dtype} {tuple(weight.shape)}")
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PREPACK_ROWS)


def _matmul_modules(model: nn.Module) -> Iterator[nn.Module]:
    """The modules whose matmul runs through ``linear``: those that declare a ``matmul`` attribute
    (``MatmulConfig`` or None: the linear layers of pagedgen.layers.linear and the lm_head)."""
    for module in model.modules():
        if hasattr(module, "matmul") and isinstance(getattr(module, "weight", None), torch.Tensor):
            yield module


def prepare_matmuls(model: nn.Module, config: MatmulConfig) -> int:
    """Apply ``config`` to every linear layer and lm_head of a loaded ``model``: weights and biases
    converted to ``config.weight_dtype`` one at a time (the old copy freed), weights packed in panels
    (``config.panels``) or, of at least ``config.prepack_min_numel`` elements, prepacked for oneDNN
    (the dense copy freed), and ``module.matmul = config``. An lm_head tied to its embedding that is
    converted or packed gets its own matrix; the embedding keeps its own. Returns the bytes the
    weights took in addition (0 when they are kept as they are; panels add the zero rows that pad
    the last one). Layers with int8 weights (``weight_scale`` set) get their weight packed by ``pack_int8`` (scales
    and bias kept as they are); FP8 weights keep the layout loading gave them (``pagedgen.layers.quant_fp8.pack_linear_fp8``)."""
    extra = 0
    for module in _matmul_modules(model):
        module.matmul = config
        for name in ("weight", "bias"):
            p = getattr(module, name)
            if p is not None and getattr(module, "weight_scale", None) is not None:  # int8 (layers/quant.py): packed in pairs;
                if name == "weight" and p.dim() == 2 and p.dtype == torch.int8:  # FP8 (layers/quant_fp8.py): kept [N, K]
                    setattr(module, name, nn.Parameter(pack_int8(p), requires_grad=False))
                continue
            if p is None:
                continue
            panels = (config.panels or config.pairs) and name == "weight"
            pack = name == "weight" and 0 < config.prepack_min_numel <= p.numel() and config.weight_dtype in PACKABLE_DTYPES
            if p.dtype == config.weight_dtype and not pack and not panels:
                continue
            shared = getattr(module, "tied", False) and name == "weight"
            new = p.detach().to(config.weight_dtype)
            new = (pack_pairs(new) if config.pairs else pack_panels(new)) if panels else prepack(new) if pack else new
            extra += new.numel() * new.element_size() - (0 if shared else p.numel() * p.element_size())
            new = nn.Parameter(new, requires_grad=False)
            if shared:
                module.tied = False  # its own matrix now; the embedding keeps the model-dtype one
            setattr(module, name, new)
    return extra
