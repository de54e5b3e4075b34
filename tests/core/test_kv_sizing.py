"""A KV cache that cannot hold one sequence of max_model_len tokens is a clear error (issue 15 item 5).

As in vLLM, max_model_len is never lowered to fit the cache: ``LLM(...)`` raises a ValueError
naming the tokens the cache holds, max_model_len, and what to change — unless the user passed a
max_model_len the cache holds. stories260K: max_position_embeddings 512, 16-token blocks.
"""
import re

import pytest

from pagedgen import LLM, SamplingParams
from pagedgen.core import kv_sizing

GREEDY = SamplingParams(temperature=0, max_tokens=8)


def test_default_max_model_len_too_long_for_num_kv_blocks(stories_path):
    """Only a tiny num_kv_blocks (as to force preemption), no max_model_len: vLLM would raise."""
    with pytest.raises(ValueError) as err:
        LLM(stories_path, num_kv_blocks=4)
    msg = str(err.value)
    assert "the KV cache holds 64 tokens (4 blocks of block_size=16; sized by num_kv_blocks=4)" in msg
    assert "fewer than one sequence of max_model_len=512 tokens (the model's max_position_embeddings" in msg
    assert "raise num_kv_blocks to at least 32 or kv_cache_memory_bytes to at least" in msg
    assert msg.endswith("or pass a smaller max_model_len (at most 64)")


def test_explicit_max_model_len_too_long_and_bytes(stories_path):
    llm = LLM(stories_path, num_kv_blocks=32)  # exactly one sequence of 512 tokens: fits
    assert llm.scheduler_config.max_model_len == 512 and llm.cache_config.num_slots == 512
    longest = llm.generate([[1] + [300] * 499], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)
    assert (len(longest[0].outputs[0].token_ids), longest[0].outputs[0].finish_reason) == (12, "length")  # 512 tokens run
    block_bytes = llm.model_config.kv_bytes_per_token() * 16
    with pytest.raises(ValueError) as err:
        LLM(stories_path, kv_cache_memory_bytes=10 * block_bytes + 1, max_model_len=200)
    msg = str(err.value)
    assert "holds 160 tokens (10 blocks of block_size=16; sized by kv_cache_memory_bytes=" in msg
    assert "max_model_len=200 tokens:" in msg and "max_position_embeddings" not in msg  # the user's own value
    assert f"num_kv_blocks to at least 13 or kv_cache_memory_bytes to at least {13 * block_bytes}" in msg
    assert "(at most 160)" in msg


def test_default_cpu_cache_too_small(stories_path, monkeypatch):
    """The CPU default (a share of the available memory) is checked the same way."""
    import psutil

    from pagedgen.model import loader

    hf_config = loader.load_hf_config(stories_path)
    block_bytes = loader.model_config_from_hf(hf_config, loader.resolve_dtype("auto", hf_config)).kv_bytes_per_token() * 16
    available = int(3.5 * block_bytes / kv_sizing.DEFAULT_CPU_KV_FRACTION)  # the default gets 3 blocks
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("vm", (), {"available": available})())
    with pytest.raises(ValueError, match=re.escape("holds 48 tokens (3 blocks of block_size=16; sized by the default, 25% of the available memory)")):
        LLM(stories_path)


def test_gpu_default_names_gpu_memory_utilization():
    sized_by = kv_sizing.sizing_source(None, None, "cuda", 0.5)
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes to at least 1024 \(or gpu_memory_utilization\), or pass"):
        kv_sizing.check_max_model_len(1, 16, 64, 256, False, sized_by)
    kv_sizing.check_max_model_len(16, 16, 64, 256, False, sized_by)  # 256 slots hold 256 tokens


def test_explicit_smaller_max_model_len_that_fits(stories_path, llm):
    """The user asked for a max_model_len the small cache holds: it runs, and is enforced."""
    small = LLM(stories_path, num_kv_blocks=4, max_model_len=64)
    assert small.scheduler_config.max_model_len == 64
    prompts = ["Once upon a time", "The little dog"]
    got = small.generate(prompts, GREEDY, use_tqdm=False)
    want = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    with pytest.raises(ValueError, match="max_model_len"):
        small.generate([[1] + [300] * 64], GREEDY, use_tqdm=False)  # 65 prompt tokens
    assert small.generate(prompts[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == got[0].outputs[0].token_ids


@pytest.mark.parametrize("backend", ["mp", "pickle"])
def test_worker_backends_on_a_gpu_need_the_kv_size_before_anything_loads(stories_path, monkeypatch, backend):
    # on a GPU the KV cache is sized by a profiling pass over the model, which only the worker holds:
    # the size must be given. A fake device check stands for the GPU (none here); nothing is loaded
    import torch

    from pagedgen import inputs
    from pagedgen.model import loader

    if backend not in __import__("pagedgen.llm_args", fromlist=["BACKENDS"]).BACKENDS:
        pytest.skip(f"no {backend!r} backend in this build")
    monkeypatch.setattr(inputs, "resolve_device", lambda device: torch.device("cuda"))
    class Loaded(Exception):
        pass

    def load_hf_config(*args):
        raise Loaded("loaded the model's config")

    monkeypatch.setattr(loader, "load_hf_config", load_hf_config)
    with pytest.raises(ValueError, match=rf"LLM distributed_executor_backend='{backend}' on a GPU needs num_kv_blocks or "
                                         r"kv_cache_memory_bytes \(--num-kv-blocks / --kv-cache-memory-bytes\)"):
        LLM(stories_path, distributed_executor_backend=backend)
    with pytest.raises(Loaded):  # with a size: past the check, to the loading
        LLM(stories_path, distributed_executor_backend=backend, num_kv_blocks=64, enforce_extension=False)
