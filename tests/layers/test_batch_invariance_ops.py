"""Batch invariance of the Python-side ops of a step (issue 13): each op's output rows do not depend on
the other rows.

The compiled kernels (norms, RoPE, silu_and_mul, the KV-cache write, paged attention with prefill
chunks vs decode) are covered by tests/ops/test_ops_batch_invariance.py. Here: every matmul path of
``pagedgen.layers.linear`` (the one this machine takes, and each path forced), the lm_head, the
embeddings, the PyTorch norms and activations of the other families, the log-softmax and logprob
dictionaries, and the sampler. For each: the same row computed alone, in a batch of 7 and in a batch
of 300 at several positions (and past ``MAX_ROWS`` for the matmuls), bitwise. Since MKL and oneDNN
choose kernels by CPU, shape and thread count, these check the property on the machine they run on.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedgen import ops
from pagedgen.core.sequence import Sequence
from pagedgen.layers import matmul as lin
from pagedgen.layers.activation import ActAndMul
from pagedgen.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedgen.layers.linear import ReplicatedLinear
from pagedgen.layers.norm import LayerNorm, RMSNorm
from pagedgen.sample.logprobs import logprob_dicts
from pagedgen.sample.sampler import Sampler
from pagedgen.sampling_params import SamplingParams

BATCHES = [(1, [0]), (7, [0, 3, 6]), (300, [0, 151, 299])]  # batch size, positions of the row in it
LONG = (lin.MAX_ROWS + 76, [0, lin.MAX_ROWS - 1, lin.MAX_ROWS, lin.MAX_ROWS + 75])  # past one row block
# [N, K]: stories260K (qkv, o, gate_up, down, lm_head), the GQA head-size-64 test model, SmolLM-135M's qkv/down
SHAPES = [(128, 64), (344, 64), (64, 172), (512, 64), (512, 256), (256, 512), (4096, 256), (960, 576)]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same_bits(a: torch.Tensor, b: torch.Tensor, what) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(bits(a), bits(b)), what


def placements(row: torch.Tensor, make_others, run, batches=BATCHES) -> None:
    """Place ``row`` at each position of each batch size (the other rows from make_others(n)) and
    check that run(batch)[position] has the same bits every time."""
    first = None
    for n, positions in batches:
        for at in positions:
            batch = make_others(n)
            batch[at] = row
            out = run(batch)[at]
            if first is None:
                first = out
            assert_same_bits(out, first, (n, at))


def matmul_configs(dtype: torch.dtype) -> list[lin.MatmulConfig]:
    """The batch-invariant config this machine chooses for ``dtype``, for bf16/fp16 both dense paths
    (the dtype's own GEMM and float32 weights), the packed-panel GEMM wherever it is built, and for
    bf16 the bf16-pair GEMM wherever it is built."""
    chosen = lin.choose_matmul(dtype, torch.device("cpu"), batch_invariant=True)
    configs = [chosen]
    if dtype != torch.float32:
        other = torch.float32 if chosen.weight_dtype == dtype and not (chosen.panels or chosen.pairs) else dtype
        configs.append(lin.MatmulConfig(other, lin.MIN_ROWS, lin.MAX_ROWS))
    if ops.has_kernel("packed_linear") and not chosen.panels:
        configs.append(lin.MatmulConfig(dtype, panels=True))
    if dtype == torch.bfloat16 and ops.has_kernel("packed_linear_bf16") and not chosen.pairs:
        configs.append(lin.MatmulConfig(dtype, pairs=True))
    return configs


def config_weights(w: torch.Tensor, config: lin.MatmulConfig) -> list[torch.Tensor]:
    """``w`` [N, K] as ``config`` runs it: in panels, or dense in its weight dtype (and prepacked for
    oneDNN too where that is supported, the path of weights of >= PREPACK_MIN_NUMEL)."""
    if config.panels:
        return [lin.pack_panels(w.to(config.weight_dtype))]
    if config.pairs:
        return [lin.pack_pairs(w.to(config.weight_dtype))]
    weights = [w.to(config.weight_dtype)]
    if config.weight_dtype == torch.float32 and lin.onednn_prepack_supported():
        weights.append(lin.prepack(weights[0]))
    return weights


# ---- matmuls ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_linear_rows_independent(shape, dtype):
    n_out, k = shape
    g = gen(n_out * 7 + k)
    w = torch.randn(n_out, k, generator=g).to(dtype)
    bias = torch.randn(n_out, generator=g).to(dtype)
    row = torch.randn(k, generator=g).to(dtype)
    for config in matmul_configs(dtype):
        b_c = bias.to(config.weight_dtype)
        # past MAX_ROWS on the small shapes (the row blocks), on the fp32 GEMM only (bf16's blocks: the test below)
        batches = BATCHES + [LONG] if n_out * k <= 512 * 64 and config.weight_dtype == torch.float32 else BATCHES
        for weight in config_weights(w, config):
            for b in (None, b_c):
                placements(row, lambda n: torch.randn(n, k, generator=g).to(dtype), lambda x: lin.linear(x, weight, b, config, n_out), batches)


# [N, K] of the benchmark models: random-135m (SmolLM-135M: qkv, o, gate_up, down, lm_head) and
# random-1b (TinyLlama-1.1B: qkv, down), where the GEMM libraries change kernels with M
MODEL_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (2560, 2048), (2048, 5632)]
EVERY_ROW_BATCHES = [2, 3, 5, 8, 12, 16, 17, 31, 32, 33, 40, 57, 58, 64, 100, 300, 1100]


# fp16 only where it has a GEMM of its own (elsewhere it takes bf16's float32 path)
EVERY_ROW_DTYPES = [torch.float32, torch.bfloat16] + ([torch.float16] if lin.native_reduced_precision(torch.float16) or lin.cpu_matmul_backend() == "pagedgen" else [])


@pytest.mark.parametrize("dtype", EVERY_ROW_DTYPES, ids=str)
@pytest.mark.parametrize("shape", MODEL_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_linear_every_row_as_alone_at_model_shapes(shape, dtype):
    """Every row of batches of 2-1,100 rows has the bits it has alone, with the weight prepared as
    an LLM prepares it (prepacked or not, the row blocks of the chosen config)."""
    n_out, k = shape
    g = gen(n_out + k)
    layer = ReplicatedLinear(k, n_out, bias=True)
    layer.weight = torch.nn.Parameter((torch.randn(n_out, k, generator=g) * 0.05).to(dtype), requires_grad=False)
    layer.bias = torch.nn.Parameter(torch.randn(n_out, generator=g).to(dtype), requires_grad=False)
    lin.prepare_matmuls(layer, lin.choose_matmul(dtype, torch.device("cpu"), batch_invariant=True))
    x = torch.randn(max(EVERY_ROW_BATCHES), k, generator=g).to(dtype)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(64)])
    for m in EVERY_ROW_BATCHES:
        y = layer(x[:m])[:64]
        differ = (bits(y) != bits(alone[:m])).any(-1).nonzero().flatten().tolist()
        assert not differ, f"batch of {m} rows: rows {differ[:8]} differ from the row alone"


def test_linear_keeps_the_activation_dtype_and_rounds_once():
    g = gen(3)
    x, w = torch.randn(5, 64, generator=g).to(torch.bfloat16), torch.randn(32, 64, generator=g)
    config = lin.MatmulConfig(torch.float32, lin.MIN_ROWS, lin.MAX_ROWS)
    y = lin.linear(x, w, None, config)
    assert y.dtype == torch.bfloat16 and y.shape == (5, 32)
    assert torch.equal(y, F.linear(F.pad(x.float(), (0, 0, 0, lin.MIN_ROWS - 5)), w)[:5].to(torch.bfloat16))
    assert lin.linear(x[:0], w, None, config).shape == (0, 32)


def test_lm_head_rows_independent():
    for dtype in (torch.float32, torch.bfloat16):
        g = gen(11)
        head = ParallelLMHead(4096, 256)
        head.weight = torch.nn.Parameter(torch.randn(4096, 256, generator=g).to(dtype), requires_grad=False)
        lin.prepare_matmuls(head, lin.choose_matmul(dtype, torch.device("cpu"), True))
        row = torch.randn(256, generator=g).to(dtype)
        placements(row, lambda n: torch.randn(n, 256, generator=g).to(dtype), head)


def test_prepare_matmuls_keeps_a_tied_embedding_and_counts_the_bytes():
    embed = VocabParallelEmbedding(512, 64)
    embed.weight = torch.nn.Parameter(torch.randn(512, 64).to(torch.bfloat16), requires_grad=False)
    model = torch.nn.ModuleDict(dict(embed=embed, head=ParallelLMHead(512, 64, tie_to=embed), proj=ReplicatedLinear(64, 32, bias=True)))
    model["proj"].weight = torch.nn.Parameter(torch.randn(32, 64).to(torch.bfloat16), requires_grad=False)
    model["proj"].bias = torch.nn.Parameter(torch.randn(32).to(torch.bfloat16), requires_grad=False)
    before = model["embed"].weight.clone()
    extra = lin.prepare_matmuls(model, lin.MatmulConfig(torch.float32, lin.MIN_ROWS, lin.MAX_ROWS))
    assert extra == 512 * 64 * 4 + (32 * 64 + 32) * 2  # the head's own fp32 matrix; the projection's 2 more bytes each
    assert model["embed"].weight.dtype == torch.bfloat16 and torch.equal(model["embed"].weight, before)
    assert model["head"].weight.dtype == torch.float32 and torch.equal(model["head"].weight, before.float())
    assert model["head"].weight is not model["embed"].weight and model["head"].matmul.weight_dtype == torch.float32
    assert model["proj"].weight.dtype == model["proj"].bias.dtype == torch.float32
    assert lin.prepare_matmuls(model, lin.MatmulConfig(torch.float32)) == 0  # already in that dtype


def test_choose_matmul(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("PAGEDGEN_CPU_MATMUL", "onednn")  # the library paths; "auto" below
    chosen = lin.choose_matmul(torch.float32, cpu, True)
    onednn = lin.onednn_prepack_available()
    assert onednn == lin.onednn_prepack_supported()
    packed = dict(prepack_min_numel=lin.PREPACK_MIN_NUMEL, packed_min_rows=lin.PACKED_MIN_ROWS, packed_max_rows=lin.MAX_ROWS) if onednn else {}
    assert chosen == lin.MatmulConfig(torch.float32, lin.MIN_ROWS, lin.MAX_ROWS, chosen.reason, long_k_max_rows=lin.LONG_K_MAX_ROWS, **packed)
    assert chosen.row_blocks(torch.empty(8, lin.LONG_K + 1)) == (lin.MIN_ROWS, lin.LONG_K_MAX_ROWS)
    assert chosen.row_blocks(torch.empty(8, lin.LONG_K)) == (lin.MIN_ROWS, lin.MAX_ROWS)
    assert not lin.choose_matmul(torch.float32, cpu, False).batch_invariant
    bf16 = lin.choose_matmul(torch.bfloat16, cpu, True)
    if lin.native_reduced_precision(torch.bfloat16):
        lo, hi = lin.bf16_row_blocks()
        assert (lo, hi) == (lin.BF16_MIN_ROWS, lin.BF16_MAX_ROWS if lin.amx_available() else lin.MAX_ROWS)
        rows = dict(min_rows=lo, max_rows=hi, packed_min_rows=lo, packed_max_rows=hi)
        assert bf16 == lin.MatmulConfig(torch.bfloat16, reason=bf16.reason, prepack_min_numel=lin.PREPACK_MIN_NUMEL_BF16 if onednn else 0, **rows)
        assert bf16.batch_invariant and not lin.choose_matmul(torch.bfloat16, cpu, False).batch_invariant
    else:
        assert bf16.weight_dtype == torch.float32 and bf16.min_rows == lin.MIN_ROWS
    if lin.native_reduced_precision(torch.float16):
        fp16 = lin.choose_matmul(torch.float16, cpu, True)
        assert (fp16.weight_dtype, fp16.min_rows, fp16.max_rows, fp16.prepack_min_numel) == (torch.float16, lin.FP16_MIN_ROWS, lin.MAX_ROWS, 0)
    with pytest.raises(ValueError, match="batch_invariant=True is available on the CPU only"):
        lin.choose_matmul(torch.bfloat16, torch.device("cuda"), True)
    assert lin.choose_matmul(torch.bfloat16, torch.device("cuda"), False).weight_dtype == torch.bfloat16
    assert lin.choose_matmul(torch.float32, torch.device("cuda"), False).prepack_min_numel == 0
    monkeypatch.setenv("PAGEDGEN_CPU_MATMUL", "mkl")
    assert lin.choose_matmul(torch.float32, cpu, True).prepack_min_numel == 0
    assert lin.choose_matmul(torch.bfloat16, cpu, False).prepack_min_numel == 0
    monkeypatch.setenv("PAGEDGEN_CPU_MATMUL", " MKL ")  # any case, spaces around
    assert lin.cpu_matmul_backend(torch.float32) == "mkl"
    monkeypatch.setenv("PAGEDGEN_CPU_MATMUL", "OneDNN")
    assert lin.cpu_matmul_backend(torch.float32) == "onednn"
    monkeypatch.setenv("PAGEDGEN_CPU_MATMUL", "blas")
    with pytest.raises(ValueError, match=r"PAGEDGEN_CPU_MATMUL must be one of \('auto', 'pagedgen', 'onednn', 'mkl', 'amx'\), got 'blas'"):
        lin.choose_matmul(torch.float32, cpu, True)


def test_choose_matmul_packed_panels(monkeypatch):
    """"auto" takes the packed-panel GEMM on AVX2 CPUs where it is built, for every dtype, and the
    bf16-pair GEMM for bf16 on AVX512-BF16 CPUs without AMX where it is built, batch-invariant either
    way; "pagedgen" asks for them anywhere and is an error where they are not built. (The AMX GEMM,
    which "auto" takes for bf16 where cpu_has_amx(): tests/ops/test_packed_linear_amx.py.)"""
    cpu = torch.device("cpu")
    monkeypatch.delenv("PAGEDGEN_CPU_MATMUL", raising=False)
    monkeypatch.setattr(lin.choice, "cpu_has_amx", lambda: False)
    auto = lin.choose_matmul(torch.bfloat16, cpu, False)
    avx2 = ops.has_kernel("packed_linear") and torch.backends.cpu.get_cpu_capability() == "AVX2"
    pairs = not avx2 and lin.bf16_pairs_available() and not lin.amx_available()
    assert auto.panels == avx2 and auto.pairs == pairs and auto.batch_invariant == (avx2 or pairs)
    assert lin.cpu_matmul_backend() == ("pagedgen" if avx2 else "onednn")  # no dtype: the float32 path
    assert lin.cpu_matmul_backend(torch.bfloat16) == ("pagedgen" if avx2 or pairs else "onednn")
    for dtype in (torch.float32, torch.float16):  # the pairs are bf16's only
        assert not lin.choose_matmul(dtype, cpu, True).pairs
    monkeypatch.setenv("PAGEDGEN_CPU_MATMUL", "pagedgen")
    if not ops.has_kernel("packed_linear"):
        with pytest.raises(ValueError, match="PAGEDGEN_CPU_MATMUL=pagedgen needs pagedgen._C built with AVX2 and FMA"):
            lin.choose_matmul(torch.float32, cpu, True)
        return
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for invariant in (True, False):
            config = lin.choose_matmul(dtype, cpu, invariant)
            if dtype == torch.bfloat16 and lin.bf16_pairs_available():
                assert config == lin.MatmulConfig(dtype, reason=config.reason, pairs=True) and config.batch_invariant
                assert "bf16 pairs" in config.reason
                continue
            assert config == lin.MatmulConfig(dtype, reason=config.reason, panels=True) and config.batch_invariant
            assert "packed-panel" in config.reason


def test_bf16_pairs_available_needs_the_kernel_avx512_and_the_cpu_flag(monkeypatch):
    """The bf16-pair GEMM is taken only where its kernel is built, torch's capability is AVX512 and
    /proc/cpuinfo lists avx512_bf16; with AMX tiles that the loaded kernels cannot use (cpu_has_amx() False)
    "auto" keeps oneDNN's AMX GEMM (tests/ops/test_packed_linear_amx.py: the AMX GEMM where they can)."""
    if not ops.has_kernel("packed_linear_bf16"):
        assert not lin.bf16_pairs_available()
        return
    assert lin.bf16_pairs_available() == (torch.backends.cpu.get_cpu_capability() == "AVX512" and lin.cpu_has_flag("avx512_bf16"))
    monkeypatch.setattr(lin.choice, "cpu_has_flag", lambda flag: False)
    assert not lin.bf16_pairs_available()
    monkeypatch.setattr(lin.choice, "cpu_has_flag", lambda flag: True)
    monkeypatch.setattr(lin.choice, "amx_available", lambda: True)
    monkeypatch.setattr(lin.choice, "cpu_has_amx", lambda: False)
    monkeypatch.delenv("PAGEDGEN_CPU_MATMUL", raising=False)
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        assert lin.cpu_matmul_backend(torch.bfloat16) == "onednn" and not lin.choose_matmul(torch.bfloat16, torch.device("cpu"), True).pairs


def test_bf16_row_blocks_without_an_amx_probe_take_the_amx_blocks(monkeypatch):
    """A torch that cannot tell whether the CPU has AMX gets the 32-row blocks, which were
    batch-invariant on every CPU measured (the 1,024-row ones only without AMX)."""
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    assert lin.amx_available()
    assert lin.bf16_row_blocks() == (lin.BF16_MIN_ROWS, lin.BF16_MAX_ROWS)


needs_onednn = pytest.mark.skipif(not lin.onednn_prepack_supported(), reason="no oneDNN prepacking on this CPU")


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prepacked_linear_matches_f_linear(dtype):
    g = gen(5)
    w, bias = torch.randn(96, 80, generator=g), torch.randn(96, generator=g)
    packed = lin.prepack(w)
    assert packed.is_mkldnn and packed.shape == (96, 80) and packed.dtype == torch.float32
    config = lin.MatmulConfig(torch.float32, lin.MIN_ROWS, lin.MAX_ROWS, prepack_min_numel=1)
    for m in (0, 1, 5, 40):
        x = torch.randn(m, 80, generator=g).to(dtype)
        for b in (None, bias):
            ref = F.linear(x.float(), w, b)
            y = lin.linear(x, packed, b, config)
            assert y.dtype == dtype and y.shape == (m, 96)
            torch.testing.assert_close(y, ref.to(dtype), rtol=1e-5, atol=1e-5)
    x = torch.randn(80, 7, generator=g).t()  # non-contiguous rows
    torch.testing.assert_close(lin.linear(x, packed), F.linear(x, w), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="prepack needs a non-empty 2-D float32 or bfloat16 weight"):
        lin.prepack(w.to(torch.float16))
    with pytest.raises(ValueError, match=r"got torch.float32 \(0, 80\)"):
        lin.prepack(w[:0])
    with pytest.raises(TypeError, match="prepack needs a torch.Tensor weight, got list"):
        lin.prepack([[1.0]])


@needs_onednn
@pytest.mark.skipif(not lin.native_reduced_precision(torch.bfloat16), reason="no oneDNN bf16 on this CPU")
def test_bf16_weights_are_prepacked_where_onednn_has_bf16(monkeypatch):
    monkeypatch.setenv("PAGEDGEN_CPU_MATMUL", "onednn")
    g = gen(6)
    layer = ReplicatedLinear(80, 96, bias=True)
    w, bias = torch.randn(96, 80, generator=g).to(torch.bfloat16), torch.randn(96, generator=g).to(torch.bfloat16)
    layer.weight, layer.bias = (torch.nn.Parameter(t, requires_grad=False) for t in (w, bias))
    assert lin.prepare_matmuls(layer, lin.choose_matmul(torch.bfloat16, torch.device("cpu"), True)) == 0  # same bytes
    assert layer.weight.is_mkldnn and layer.weight.dtype == torch.bfloat16 and not layer.bias.is_mkldnn
    for m in (0, 1, 5, 40, 77):  # 1: padded to BF16_MIN_ROWS; 77: blocks of BF16_MAX_ROWS with AMX
        x = torch.randn(m, 80, generator=g).to(torch.bfloat16)
        y = layer(x)
        assert y.dtype == torch.bfloat16 and y.shape == (m, 96)
        torch.testing.assert_close(y, F.linear(x, w, bias), rtol=1.6e-2, atol=1e-2)


@needs_onednn
def test_prepare_matmuls_prepacks_large_weights_only():
    embed = VocabParallelEmbedding(512, 64)
    embed.weight = torch.nn.Parameter(torch.randn(512, 64), requires_grad=False)
    model = torch.nn.ModuleDict(dict(embed=embed, head=ParallelLMHead(512, 64, tie_to=embed), small=ReplicatedLinear(64, 8, bias=True)))
    model["small"].weight = torch.nn.Parameter(torch.randn(8, 64), requires_grad=False)
    model["small"].bias = torch.nn.Parameter(torch.randn(8), requires_grad=False)
    before, x = embed.weight.clone(), torch.randn(3, 64)
    config = lin.MatmulConfig(torch.float32, lin.MIN_ROWS, lin.MAX_ROWS, prepack_min_numel=512 * 64)
    extra = lin.prepare_matmuls(model, config)
    assert extra == 512 * 64 * 4  # the head's own packed matrix; the embedding keeps its dense one
    assert model["head"].weight.is_mkldnn and not model["head"].tied
    assert not model["embed"].weight.is_mkldnn and torch.equal(model["embed"].weight, before)
    assert not model["small"].weight.is_mkldnn and not model["small"].bias.is_mkldnn  # under the threshold
    torch.testing.assert_close(model["head"](x), F.linear(x, before), rtol=1e-5, atol=1e-5)


# ---- embeddings, the other families' norms and activations ------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_embedding_norms_and_activations_rows_independent(dtype):
    g = gen(5)
    hidden = 96
    embed = VocabParallelEmbedding(1000, hidden, scale=hidden**0.5)
    embed.weight = torch.nn.Parameter(torch.randn(1000, hidden, generator=g).to(dtype), requires_grad=False)
    placements(torch.tensor(417), lambda n: torch.randint(0, 1000, (n,), generator=g), embed)
    for norm in (RMSNorm(hidden, 1e-6, gemma=True), LayerNorm(hidden, 1e-5)):
        for name, p in norm.named_parameters():
            setattr(norm, name, torch.nn.Parameter(torch.randn(p.shape, generator=g).to(dtype), requires_grad=False))
        row = (torch.randn(hidden, generator=g) * 3).to(dtype)
        placements(row, lambda n: (torch.randn(n, hidden, generator=g) * 3).to(dtype), norm)
        res_row = torch.randn(hidden, generator=g).to(dtype)
        placements(torch.stack([row, res_row]), lambda n: torch.randn(n, 2, hidden, generator=g).to(dtype),
                   lambda xr: torch.stack(norm(xr[:, 0], xr[:, 1].clone()), dim=1))
    for act in ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu"):
        fn = ActAndMul(act)
        row = (torch.randn(2 * hidden, generator=g) * 3).to(dtype)
        placements(row, lambda n: (torch.randn(n, 2 * hidden, generator=g) * 3).to(dtype), fn)


# ---- log-softmax, logprobs, sampling -----------------------------------------------------------------


@pytest.mark.parametrize("vocab", [512, 4096, 50257])
def test_log_softmax_and_logprob_dicts_rows_independent(vocab):
    g = gen(vocab)
    row = torch.randn(vocab, generator=g) * 4
    batches = BATCHES if vocab < 50000 else BATCHES[:2] + [(300, [151])]
    placements(row, lambda n: torch.randn(n, vocab, generator=g) * 4, lambda x: x.log_softmax(dim=-1), batches)
    dicts = []
    for n, positions in batches:
        for at in positions:
            logits = torch.randn(n, vocab, generator=g) * 4
            logits[at] = row
            ids = torch.randint(0, vocab, (n,), generator=g)
            ids[at] = 7
            got = logprob_dicts(logits.log_softmax(dim=-1), ids, [5] * n)[at]
            dicts.append([(k, v.logprob, v.rank) for k, v in got.items()])
    assert all(d == dicts[0] for d in dicts)


def _seq(i: int, params: SamplingParams, history: list[int]) -> Sequence:
    return Sequence(seq_id=i, request_id=str(i), token_ids=list(history), num_prompt_tokens=3, sampling_params=params,
                    eos_token_ids=frozenset({2}), max_model_len=512, seed=params.seed)


OTHER_PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=0.5, seed=9, logprobs=2, presence_penalty=0.5),
    SamplingParams(temperature=0.8, top_p=0.7, min_p=0.1, logit_bias={3: 2.0}),
    SamplingParams(temperature=0.0, logprobs=0, min_tokens=4),
]


@pytest.mark.parametrize("target", [
    SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.02, seed=1234, logprobs=3, repetition_penalty=1.2, frequency_penalty=0.3),
    SamplingParams(temperature=0.0, logprobs=4),
    SamplingParams(temperature=1.0, seed=5),
], ids=["seeded-processed", "greedy-logprobs", "seeded-plain"])
def test_sampler_rows_independent(target):
    vocab = 1024
    g = gen(21)
    row = torch.randn(vocab, generator=g) * 3
    history = torch.randint(0, vocab, (20,), generator=g).tolist()
    results = []
    for n, positions in BATCHES[:2] + [(300, [0, 299])]:
        for at in positions:
            logits = torch.randn(n, vocab, generator=g) * 3
            logits[at] = row
            seqs = [_seq(i, OTHER_PARAMS[i % len(OTHER_PARAMS)], torch.randint(0, vocab, (5,), generator=g).tolist()) for i in range(n)]
            seqs[at] = _seq(at, target, history)  # keyed by its seed, index and position: the same draws
            out = Sampler(seed=n + at)(logits, seqs)  # other engine seeds: rows without a seed differ
            results.append((out.token_ids[at], None if out.logprobs is None else out.logprobs[at]))
    assert all(r == results[0] for r in results), results


def test_ties_are_broken_by_token_id_in_any_batch():
    """bf16 logits tie often: top-k logprobs and top-p keep equal logits in token-id order, whatever the batch."""
    from pagedgen.sample import logits_processors as lp

    g = gen(8)
    vocab = 2048

    def tied(n):
        return (torch.randn(n, vocab, generator=g) * 2).to(torch.bfloat16).float()  # ~256 distinct values per row

    row = tied(1)[0]
    lps = row.log_softmax(dim=-1)
    expected = sorted(range(vocab), key=lambda j: (-lps[j].item(), j))[:20]
    assert logprob_dicts(lps[None], torch.tensor([expected[0]]), [20])[0].keys() == set(expected)
    for n, positions in BATCHES:
        for at in positions:
            logits = tied(n)
            logits[at] = row
            d = logprob_dicts(logits.log_softmax(dim=-1), torch.full((n,), expected[3]), [20] * n)[at]
            assert list(d) == [expected[3]] + expected[:3] + expected[4:] and d[expected[3]].rank == 4  # the chosen token first
            masked = lp.apply_top_k_top_p(logits, torch.full((n,), 30), torch.full((n,), 0.5))[at]
            alone = lp.apply_top_k_top_p(row[None], torch.tensor([30]), torch.tensor([0.5]))[0]
            assert torch.equal(masked, alone), (n, at)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("neox_style, rotary_dim", [(True, 64), (True, 32), (False, 64), (False, 16)])
def test_rotary_embedding_layer_rows_independent(neox_style, rotary_dim, dtype):
    """The layer as models call it (partial rotary, GPT-J pairs in PyTorch), on q/k views of a fused qkv."""
    from pagedgen.layers.rotary_embedding import RotaryEmbedding

    g = gen(rotary_dim)
    heads, kv_heads, d = 4, 2, 64
    rope = RotaryEmbedding(d, rotary_dim, 512, 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim), 1.0, neox_style)
    width = (heads + 2 * kv_heads) * d
    row = torch.cat([torch.randn(width, generator=g), torch.tensor([300.0])])  # qkv features, then the position

    def run(batch):
        qkv, positions = batch[:, :-1].to(dtype).contiguous(), batch[:, -1].long()
        n = qkv.shape[0]
        q = qkv[:, : heads * d].view(n, heads, d)
        k = qkv[:, heads * d : (heads + kv_heads) * d].view(n, kv_heads, d)
        rope(positions, q, k)
        return qkv

    def others(n):
        return torch.cat([torch.randn(n, width, generator=g), torch.randint(0, 512, (n, 1), generator=g).float()], dim=1)

    placements(row, others, run)
