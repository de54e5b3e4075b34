"""An int8 W8A8 model whose GEMMs of 16 rows or more run on the AMX-INT8 path (``int8_linear_amx``; here
its emulated twin, swapped in, with AMX-INT8 reported) gives the AVX2 path's tokens and logprobs bit for
bit: the layers switch path by M (prefill steps on AMX, decode steps of few rows on AVX2) without
changing a row's bits (docs/quantization.md, docs/determinism.md)."""
from __future__ import annotations

import pytest
import torch

from pagedgen import LLM, SamplingParams, ops
from pagedgen.layers import matmul as lin

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(not ops.has_kernel("int8_linear_amx_emulated"),
                                 reason="pagedgen._C was built without the AMX int8 GEMM ops (they need AVX2)")]


def _generate(path, prompts):
    llm = LLM(path, quantization="int8", dtype="float32", max_model_len=128, seed=0)
    sp = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    rows = llm.matmul_config.int8_amx_min_rows
    return rows, [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob, o.outputs[0].logprobs) for o in outs]


def test_amx_path_by_rows_is_bitwise_the_avx2_path(stories_path, monkeypatch):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (40, 5, 23, 9, 17, 2)]
    monkeypatch.setenv("PAGEDGEN_CPU_INT8", "avx2")
    rows, want = _generate(stories_path, prompts)
    assert rows == 0
    calls = []

    def emulated(out, *args):
        calls.append(out.shape[0])
        torch.ops.pagedgen.int8_linear_amx_emulated(out, *args)

    monkeypatch.setenv("PAGEDGEN_CPU_INT8", "auto")
    monkeypatch.setattr(lin.int8_amx, "cpu_has_amx_int8", lambda: True)
    monkeypatch.setattr(lin.int8_amx, "_DECIDED", [])
    monkeypatch.setattr(torch.ops.pagedgen, "int8_linear_amx", emulated)
    assert lin.int8_amx_min_rows() == lin.INT8_AMX_MIN_ROWS  # decided once (the self-check's calls), then kept
    calls.clear()
    rows, got = _generate(stories_path, prompts)
    assert rows == lin.INT8_AMX_MIN_ROWS
    assert calls and min(calls) >= lin.INT8_AMX_MIN_ROWS  # the prefill steps ran on the (emulated) AMX tiles
    assert got == want
