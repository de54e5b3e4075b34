"""The CPU kernels' instruction-set levels (pagedgen/ops/isa.py, setup.py's CPU_LEVELS): which level a
process loads, what PAGEDGEN_CPU_ISA does, and that every level this CPU runs gives the reference ops'
results (each in its own process: one level is loaded per process).

The wheel built once and run with each level forced is tests/project/test_wheel.py."""
import json
import os
import subprocess

import pytest
import torch

import pagedgen.ops as ops
from outside_checkout import python_c
from pagedgen.ops import isa

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
needs_ext = pytest.mark.skipif(ops._IMPORT_ERROR is not None, reason="pagedgen._C is not built")

ALL = ("avx2", "avx512_bf16", "amx")


@pytest.mark.parametrize("request_, supported, built, expected", [
    ("auto", ALL, ALL, "amx"),
    ("auto", ("avx2", "avx512_bf16"), ALL, "avx512_bf16"),
    ("auto", ("avx2",), ALL, "avx2"),
    ("auto", ALL, ("avx2",), "avx2"),                      # a build of fewer levels
    ("avx2", ALL, ALL, "avx2"),                           # a cap below the CPU's best
    ("avx512_bf16", ALL, ALL, "avx512_bf16"),
    ("amx", ("avx2",), ALL, "avx2"),                      # a cap above the CPU's best is no cap
    ("auto", (), ("generic",), "generic"),                # another architecture
    ("native", ("avx2",), ALL + ("native",), "native"),   # only when asked for
    ("auto", ("avx2",), ALL + ("native",), "avx2"),
])
def test_choose(request_, supported, built, expected):
    assert isa.choose(request_, supported, built) == (expected, "")


@pytest.mark.parametrize("request_, supported, built, words", [
    ("none", ALL, ALL, ["PAGEDGEN_CPU_ISA=none"]),
    ("auto", (), ALL, ["built: avx2, avx512_bf16, amx", "run: none", "AVX2 and FMA are the least"]),
    ("avx512_bf16", ALL, ("amx",), ["up to avx512_bf16", "built: amx"]),
    ("native", ALL, ALL, ["PAGEDGEN_CPU_ISA=native", "built without that level"]),
    ("auto", ALL, (), ["built: none"]),
])
def test_choose_none_says_why(request_, supported, built, words):
    level, why = isa.choose(request_, supported, built)
    assert level is None and all(w in why for w in words), why


@pytest.mark.parametrize("value, expected", [(None, "auto"), ("", "auto"), (" AVX2 ", "avx2"), ("Amx", "amx"),
                                             ("none", "none"), ("native", "native")])
def test_check_request(value, expected):
    assert isa.check_request(value) == expected


@pytest.mark.parametrize("value", ["avx512", "sse4", "avx-2", "1"])
def test_check_request_names_the_choices(value):
    with pytest.raises(ValueError, match=r"PAGEDGEN_CPU_ISA=.*expected one of auto, none, avx2, avx512_bf16, amx"):
        isa.check_request(value)


@needs_ext
def test_the_loaded_level_is_the_best_this_cpu_runs():
    """Unless PAGEDGEN_CPU_ISA says otherwise: the highest level both built and supported, and the
    kernels say they were compiled for it (the compiler's own macros, csrc/cpu/module.cpp)."""
    if os.environ.get(isa.ENV, "auto").strip().lower() not in ("", "auto"):
        pytest.skip(f"{isa.ENV} is set")
    supported, built = isa.supported_levels(), isa.built_levels()
    assert ops.cpu_isa() == isa.choose("auto", supported, built)[0]
    assert list(supported) == list(ALL[:len(supported)])  # a prefix: each level includes the ones below
    if ops.cpu_isa() is None:
        return
    feats = ops.cpu_isa_features()
    assert torch.ops.pagedgen.cpu_kernel_isa()[0] == ops.cpu_isa()
    if ops.cpu_isa() in ALL:
        assert {"avx2", "fma", "f16c"} <= feats
        assert ("avx512bf16" in feats) == (ops.cpu_isa() != "avx2")
        assert ("amx_bf16" in feats) == (ops.cpu_isa() == "amx")
        assert ("amx_int8" in feats) == (ops.cpu_isa() == "amx")  # the AMX-INT8 GEMM's build
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    assert ("avx512_bf16" in supported) <= (" avx512_bf16" in flags)
    assert ("amx" in supported) <= (" amx_tile" in flags and " amx_bf16" in flags and " amx_int8" in flags)


def _in_a_process(env_value: str, code: str) -> dict:
    env = {**os.environ, isa.ENV: env_value, "OMP_NUM_THREADS": "1"}
    # the checkout (cwd) not first on sys.path, so that a PYTHONPATH (an installed wheel) wins
    out = subprocess.run(python_c(code), env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


_REPORT = """
import json, warnings
import pagedgen.ops as o
print(json.dumps({"level": o.cpu_isa(), "error": o.extension_error("cpu")}))
"""


@needs_ext
def test_none_and_a_bad_value_load_no_cpu_kernels_and_say_why():
    got = _in_a_process("none", _REPORT)
    assert got["level"] is None and "PAGEDGEN_CPU_ISA=none" in got["error"]
    got = _in_a_process("avx512", _REPORT)
    assert got["level"] is None and "expected one of auto, none, avx2" in got["error"]


def test_a_stale_baseline_module_loads_no_cpu_kernels_and_says_why(monkeypatch):
    """A pagedgen._C older than its sources (no cpu_supported_isa op): no level is loaded, and the reason
    says to rebuild, instead of an AttributeError at ``import pagedgen``."""
    def stale():
        raise AttributeError("'_OpNamespace' 'pagedgen' object has no attribute 'cpu_supported_isa'")

    monkeypatch.setattr(isa, "supported_levels", stale)
    monkeypatch.setattr(isa, "_loaded", None)
    monkeypatch.setattr(isa, "_why_not", "")
    monkeypatch.delenv(isa.ENV, raising=False)
    isa.load()
    assert isa.loaded() is None and "older than its sources" in isa.why_not() and "scripts/setup.sh" in isa.why_not()


@needs_ext
def test_a_bad_value_is_a_value_error_of_llm(stories_path, monkeypatch):
    """LLM(...) checks PAGEDGEN_CPU_ISA before any work (a typo must not silently run the reference ops)."""
    from pagedgen import LLM

    monkeypatch.setenv(isa.ENV, "avx-512")
    with pytest.raises(ValueError, match="PAGEDGEN_CPU_ISA='avx-512': expected one of"):
        LLM(stories_path)


# Every CPU kernel against its reference, in one process per level (the op tests proper run in the
# suite's own process, at the best level; these are a quick check of the lower ones).
_CHECK = r"""
import json, torch
import pagedgen.ops as o
from pagedgen.ops import reference as ref
torch.manual_seed(0)
res = {"level": o.cpu_isa()}
x = torch.randn(37, 576); w = torch.rand(576) + 0.5
a, b = torch.empty_like(x), torch.empty_like(x)
o.rms_norm(a, x, w, 1e-5); ref.rms_norm(b, x, w, 1e-5)
res["rms_norm"] = float((a - b).abs().max())
g = torch.randn(9, 2 * 1536)
a, b = torch.empty(9, 1536), torch.empty(9, 1536)
o.silu_and_mul(a, g); ref.silu_and_mul(b, g)
res["silu_and_mul"] = float((a - b).abs().max())
nb, bs, kvh, hd, h = 16, 16, 3, 64, 9
kc, vc = torch.randn(nb, bs, kvh, hd), torch.randn(nb, bs, kvh, hd)
lens = torch.tensor([5, 40, 75], dtype=torch.int32)   # the last one a prefill chunk of 4 rows
bt = torch.randperm(nb, dtype=torch.int32)[:15].view(3, 5)
q = torch.randn(6, h, hd)
qsl = torch.tensor([0, 1, 2, 6], dtype=torch.int32)
a, b = torch.empty_like(q), torch.empty_like(q)
o.paged_attention(a, q, kc, vc, bt, lens, qsl, hd ** -0.5, 0)
ref.paged_attention(b, q, kc, vc, bt, lens, qsl, hd ** -0.5, 0)
res["paged_attention"] = float((a - b).abs().max())
if o.has_kernel("packed_linear"):
    from pagedgen.layers.matmul import packing
    W = torch.randn(100, 64); inp = torch.randn(5, 64)
    out = torch.empty(5, 100)
    o.packed_linear(out, inp, packing.pack_panels(W), None)
    res["packed_linear"] = float((out - inp @ W.T).abs().max())
if o.has_kernel("kv_dequantize_blocks"):
    from pagedgen.ops import kv_quant
    codes, scales = kv_quant.quantize(kc, torch.float8_e4m3fn)
    a, b = torch.empty(3, bs, kvh, hd, dtype=torch.bfloat16), torch.empty(3, bs, kvh, hd, dtype=torch.bfloat16)
    o.kv_dequantize_blocks(a, codes, scales, torch.tensor([4, 0, 4])); ref.kv_dequantize_blocks(b, codes, scales, torch.tensor([4, 0, 4]))
    res["kv_dequantize_blocks"] = float((a.float() - b.float()).abs().max())
if o.has_kernel("add_lora_linear"):
    la, lb = torch.randn(3, 64, 24) * 0.1, torch.randn(3, 8, 100) * 0.1
    inp, y0, slots = torch.randn(7, 64), torch.randn(7, 100), torch.tensor([0, -1, 2, 1, 2, 0, -1], dtype=torch.int32)
    a, b = y0.clone(), y0.clone()
    o.add_lora_linear(a, inp, la, lb, slots, [50, 30, 20]); ref.add_lora_linear(b, inp, la, lb, slots, [50, 30, 20])
    res["add_lora_linear"] = float((a - b).abs().max())
if o.has_kernel("logprob_topk"):
    z, t = (torch.randn(7, 1003) * 3).to(torch.bfloat16), torch.randint(0, 1003, (7,))
    a, b = torch.empty(7, 13, dtype=torch.float64), torch.empty(7, 13, dtype=torch.float64)
    o.logprob_topk(a, z, t, 5); ref.logprob_topk(b, z, t, 5)
    exact = [0, 2] + list(range(8, 13))   # ids, ranks, top ids: equal, else the error is 1
    lps = [1] + list(range(3, 8))
    res["logprob_topk"] = float((a[:, lps] - b[:, lps]).abs().max()) if torch.equal(a[:, exact], b[:, exact]) else 1.0
if o.has_kernel("int4_linear"):
    from pagedgen.layers.quant_int4 import pack_groups, pack_int4
    codes, inp = torch.randint(0, 16, (40, 64), dtype=torch.uint8), torch.randn(5, 64)
    sc, zp = pack_groups(torch.rand(40, 2) * 0.01), pack_groups(torch.randint(0, 16, (40, 2), dtype=torch.uint8))
    a, b = torch.empty(5, 40), torch.empty(5, 40)
    o.int4_linear(a, inp, pack_int4(codes), sc, zp, 32, None); ref.int4_linear(b, inp, pack_int4(codes), sc, zp, 32, None)
    res["int4_linear"] = float((a - b).abs().max())
if o.has_kernel("fp8_linear"):
    from pagedgen.layers.quant_fp8 import pack_fp8
    codes, inp = (torch.randn(40, 64) * 100).clamp(-448, 448).to(torch.float8_e4m3fn), torch.randn(5, 64)
    sc = torch.rand(40, 4) * 1e-3 + 1e-4
    a, b = torch.empty(5, 40), torch.empty(5, 40)
    o.fp8_linear(a, inp, pack_fp8(codes), sc, 16, None); ref.fp8_linear(b, inp, pack_fp8(codes), sc, 16, None)
    res["fp8_linear"] = float((a - b).abs().max())
if o.has_kernel("varlen_attention"):
    qkv, cu = torch.randn(50, 3, 4, 32), torch.tensor([0, 7, 40, 50], dtype=torch.int32)
    a, b = torch.empty(50, 4, 32), torch.empty(50, 4, 32)
    o.varlen_attention(a, *qkv.unbind(1), cu, 0.2); ref.varlen_attention(b, *qkv.unbind(1), cu, 0.2)
    res["varlen_attention"] = float((a - b).abs().max())
if o.has_kernel("fused_add_layer_norm"):
    x, r, w, bias = torch.randn(9, 70), torch.randn(9, 70), torch.randn(70), torch.randn(70)
    xa, ra, xb, rb = x.clone(), r.clone(), x.clone(), r.clone()
    o.fused_add_layer_norm(xa, ra, w, bias, 1e-5); ref.fused_add_layer_norm(xb, rb, w, bias, 1e-5)
    res["fused_add_layer_norm"] = max(float((xa - xb).abs().max()), float((ra - rb).abs().max()))
print(json.dumps(res))
"""


@needs_ext
@pytest.mark.parametrize("level", ALL)
def test_every_level_this_cpu_runs_matches_the_reference(level):
    if level not in isa.supported_levels():
        pytest.skip(f"this CPU (or its OS) does not run the {level} level")
    if level not in isa.built_levels():
        pytest.skip(f"the {level} level is not built (PAGEDGEN_CPU_LEVELS)")
    got = _in_a_process(level, _CHECK)
    assert got.pop("level") == level
    assert set(got) >= {"rms_norm", "silu_and_mul", "paged_attention", "packed_linear"}
    assert all(err < 1e-4 for err in got.values()), got
