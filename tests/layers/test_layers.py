"""pagedgen.layers against transformers' own modules, bitwise where the computation is the same
sequence of ops (the families' end-to-end tests are in test_models.py)."""
from __future__ import annotations

import pytest
import torch

from pagedgen import ops
from pagedgen.layers.activation import ACTIVATIONS, ActAndMul, get_act_fn
from pagedgen.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
from pagedgen.layers.loading import WeightShapeError
from pagedgen.layers.norm import LayerNorm, RMSNorm
from pagedgen.layers.rotary_embedding import RotaryEmbedding, get_rope, supported_rope_types

DTYPES = [torch.float32, torch.bfloat16]


def _rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("name", list(ACTIVATIONS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_activations_are_transformers(name, dtype):
    from transformers.activations import ACT2FN

    x = _rand(7, 33, dtype=dtype) * 4
    assert torch.equal(get_act_fn(name)(x), ACT2FN[name](x))


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_activation(act, dtype):
    from transformers.activations import ACT2FN

    x = _rand(5, 2 * 24, dtype=dtype) * 3
    expected = ACT2FN[act](x[:, :24].contiguous()) * x[:, 24:]  # contiguous, as transformers' gate_proj(x) output
    torch.testing.assert_close(ActAndMul(act)(x), expected, rtol=0, atol=0 if act != "silu" else 1e-2 if dtype == torch.bfloat16 else 1e-6)


def test_unknown_activation_names_the_field():
    with pytest.raises(ValueError, match="activation_function='swiglu_9' is not supported; supported: silu"):
        get_act_fn("swiglu_9", "activation_function")


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_rms_norm_is_transformers(dtype):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    ref = GemmaRMSNorm(48, eps=1e-6).to(dtype)
    ref.weight.data = _rand(48, dtype=dtype, seed=1)
    mine = RMSNorm(48, 1e-6, gemma=True).to(dtype)
    mine.weight.data = ref.weight.data.clone()
    x, residual = _rand(9, 48, dtype=dtype, seed=2), _rand(9, 48, dtype=dtype, seed=3)
    assert torch.equal(mine(x), ref(x))
    normed, summed = mine(x, residual)
    assert torch.equal(summed, residual + x) and torch.equal(normed, ref(residual + x))


@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_is_torch(affine):
    ref = torch.nn.LayerNorm(40, eps=1e-5, elementwise_affine=affine)
    mine = LayerNorm(40, 1e-5, elementwise_affine=affine)
    if affine:
        ref.weight.data, ref.bias.data = _rand(40, seed=1), _rand(40, seed=2)
        mine.weight.data, mine.bias.data = ref.weight.data.clone(), ref.bias.data.clone()
    x = _rand(6, 40, seed=3)
    assert torch.equal(mine(x), ref(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_with_residual_is_torch(affine, dtype):
    """norm(x, residual) = (LayerNorm(x + residual), x + residual): the sum bitwise, the norm within
    a few float32 ulps (ops.fused_add_layer_norm's two-pass statistics) or one ulp of bf16/fp16."""
    ref = torch.nn.LayerNorm(40, eps=1e-5, elementwise_affine=affine).to(dtype)
    mine = LayerNorm(40, 1e-5, elementwise_affine=affine).to(dtype)
    if affine:
        ref.weight.data, ref.bias.data = _rand(40, dtype=dtype, seed=1), _rand(40, dtype=dtype, seed=2)
        mine.weight.data, mine.bias.data = ref.weight.data.clone(), ref.bias.data.clone()
    x, residual = _rand(6, 40, dtype=dtype, seed=3), _rand(6, 40, dtype=dtype, seed=4) * 2
    expected_sum = x + residual
    expected = ref(expected_sum)
    normed, summed = mine(x.clone(), residual.clone())
    assert torch.equal(summed, expected_sum)
    tol = dict(atol=2e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1.6e-2, rtol=8e-3)
    torch.testing.assert_close(normed, expected, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("partial", [1.0, 0.25])
def test_neox_rotary_full_and_partial_is_transformers(dtype, partial):
    """GPT-NeoX's apply_rotary_pos_emb (rotate-half on the first rotary_dim features), bitwise."""
    from transformers import GPTNeoXConfig
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding, apply_rotary_pos_emb

    config = GPTNeoXConfig(hidden_size=128, num_attention_heads=4, max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial})
    rope = get_rope(config, head_dim=32)
    assert rope.rotary_dim == int(32 * partial)
    positions = torch.tensor([0, 5, 63, 17])
    q, k = _rand(4, 4, 32, dtype=dtype, seed=1), _rand(4, 2, 32, dtype=dtype, seed=2)
    cos, sin = GPTNeoXRotaryEmbedding(config)(q, positions[None])
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    rope(positions, q, k)
    assert torch.equal(q, q_ref[0].transpose(0, 1)) and torch.equal(k, k_ref[0].transpose(0, 1))


def test_gptj_rotary_is_transformers():
    """GPT-J style (adjacent pairs) against transformers' GPT-J functions, float32."""
    from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb, create_sinusoidal_positions

    rotary_dim, head_dim, P = 16, 24, 40
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    rope = RotaryEmbedding(head_dim, rotary_dim, P, inv_freq, neox_style=False)
    positions = torch.tensor([3, 0, 39])
    q, k = _rand(3, 2, head_dim, seed=1), _rand(3, 1, head_dim, seed=2)
    sincos = create_sinusoidal_positions(P, rotary_dim)[positions][None]  # [1, T, rotary_dim]: sin | cos
    sin, cos = torch.split(sincos, rotary_dim // 2, dim=-1)
    expected = [torch.cat([apply_rotary_pos_emb(x[None, ..., :rotary_dim], sin, cos)[0], x[..., rotary_dim:]], dim=-1) for x in (q, k)]
    rope(positions, q, k)
    assert torch.equal(q, expected[0]) and torch.equal(k, expected[1])


def test_rope_types():
    from transformers import LlamaConfig

    assert {"default", "linear", "llama3", "yarn"} <= set(supported_rope_types())
    assert "dynamic" not in supported_rope_types() and "longrope" not in supported_rope_types()
    with pytest.raises(ValueError, match=r"rope_parameters.rope_type='longrope' is not supported \(its frequencies change"):
        get_rope(LlamaConfig(hidden_size=64, num_attention_heads=4, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8, "long_factor": [1.0] * 8, "original_max_position_embeddings": 64}), 16)


def test_qkv_loader_parts_fused_interleaved_and_conv1d():
    H, D, hidden = 2, 3, 4
    w = _rand(3 * H * D, hidden, seed=1)  # rows: q heads, k heads, v heads
    parts = QKVParallelLinear(hidden, D, H, H)
    for sid, chunk in zip("qkv", w.chunk(3)):
        parts.weight_loader(parts.weight, chunk, sid)
    assert torch.equal(parts.weight, w)
    fused = QKVParallelLinear(hidden, D, H, H, bias=True)
    fused.weight_loader(fused.weight, w)
    assert torch.equal(fused.weight, w)
    conv = QKVParallelLinear(hidden, D, H, H, layout="conv1d")  # GPT-2 stores [in, out]
    conv.weight_loader(conv.weight, w.t().contiguous())
    assert torch.equal(conv.weight, w)
    # GPT-NeoX: per head [q_h; k_h; v_h]
    interleaved = torch.cat([torch.cat([w[s * H * D + h * D : s * H * D + (h + 1) * D] for s in range(3)]) for h in range(H)])
    neox = QKVParallelLinear(hidden, D, H, H, bias=True, layout="interleaved_qkv")
    neox.weight_loader(neox.weight, interleaved)
    assert torch.equal(neox.weight, w)
    with pytest.raises(WeightShapeError, match=r"has shape \(6, 4\), but config.json implies \(18, 4\)"):
        neox.weight_loader(neox.weight, w[:6])


def test_merged_loader_shape_error_and_meta_dry_run():
    gate_up = MergedColumnParallelLinear(4, [5, 5])
    with pytest.raises(WeightShapeError, match=r"has shape \(6, 4\), but config.json implies \(5, 4\)"):
        gate_up.weight_loader(gate_up.weight, torch.empty(6, 4, device="meta"), 1)
    gate_up.weight.data.zero_()
    gate_up.weight_loader(gate_up.weight, torch.empty(5, 4, device="meta"), 1)  # dry run: nothing copied
    assert not gate_up.weight.any()


def test_module_mirror_stays_in_step_with_nn_module():
    """pagedgen.layers.module.Module: calls run forward, registered members are plain attributes, and
    the mirror follows every change nn.Module makes (assignment, deletion, _apply, deepcopy, the
    loader's materialisation)."""
    import copy

    from torch import nn

    from pagedgen.layers.embedding import ParallelLMHead, VocabParallelEmbedding
    from pagedgen.layers.linear import ColumnParallelLinear
    from pagedgen.layers.module import Module
    from pagedgen.model.weights import materialize

    class Net(Module):
        def __init__(self):
            super().__init__()
            self.emb = VocabParallelEmbedding(10, 4)
            self.head = ParallelLMHead(10, 4, tie_to=self.emb)
            self.lin = ColumnParallelLinear(4, 3, bias=True)
            self.register_buffer("buf", torch.zeros(2, device="cpu"), persistent=False)

        def forward(self, x):
            return self.lin(x)

    def in_step(m):
        for mod in m.modules():
            for registry in (mod._parameters, mod._buffers, mod._modules):
                for name, value in registry.items():
                    assert mod.__dict__.get(name, "missing") is value, name

    net = Net()
    in_step(net)
    assert type(net).__call__ is Net.forward
    net.double()
    in_step(net)
    assert net.lin.weight.dtype == torch.float64 and net.head.weight is net.emb.weight
    net.lin.bias = None
    in_step(net)
    net.lin.bias = nn.Parameter(torch.ones(3, dtype=torch.float64))
    in_step(net)
    del net.buf
    assert not hasattr(net, "buf") and "buf" not in net._buffers
    twin = copy.deepcopy(net)
    in_step(twin)
    assert twin.head.weight is twin.emb.weight and twin.lin.weight is not net.lin.weight
    assert net(torch.ones(2, 4, dtype=torch.float64)).shape == (2, 3)
    with torch.device("meta"):
        meta = Net()
    materialize(meta, torch.bfloat16, torch.device("cpu"))
    in_step(meta)
    assert meta.lin.weight.dtype == torch.bfloat16 and meta.head.weight is meta.emb.weight and meta.lin.weight.weight_loader
