"""The CPU KV cache's huge-page advice (pagedgen/engine/huge_pages.py): taken where Linux allows,
refused cleanly elsewhere, values untouched."""
import sys

import pytest
import torch

from pagedgen.engine.huge_pages import HUGE_PAGE, advise_huge_pages


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "none"


@pytest.mark.skipif(not sys.platform.startswith("linux") or _thp_mode() not in ("always", "madvise"),
                    reason="needs Linux transparent huge pages (always or madvise)")
def test_advice_is_taken_and_values_kept():
    t = torch.empty(4 * HUGE_PAGE // 4, dtype=torch.float32)  # 8 MiB
    assert advise_huge_pages(t)
    t.copy_(torch.arange(t.numel(), dtype=torch.float32))
    assert torch.equal(t[:5], torch.arange(5, dtype=torch.float32)) and t[-1].item() == t.numel() - 1


def test_advice_refused_where_it_cannot_apply():
    assert not advise_huge_pages(torch.empty(16, dtype=torch.float32))  # smaller than one huge page
    big = torch.empty(2 * HUGE_PAGE // 2, 2, dtype=torch.bfloat16)
    assert not advise_huge_pages(big.t())  # not contiguous


def test_engine_cache_is_advised(stories_path, monkeypatch):
    """The engine asks for huge pages on every CPU cache tensor (2 per layer) when it is made."""
    from pagedgen import LLM
    from pagedgen.engine import model_runner

    seen = []
    monkeypatch.setattr(model_runner, "advise_huge_pages", lambda t: seen.append(t.data_ptr()) or False)
    llm = LLM(stories_path, num_kv_blocks=64, max_model_len=256)
    caches = llm.llm_engine.model_runner.kv_caches
    assert sorted(seen) == sorted(t.data_ptr() for kv in caches for t in kv) and len(seen) == 2 * len(caches)
    out = llm.generate(["Once upon a time"], use_tqdm=False)  # still generates (advice refused here)
    assert out[0].outputs[0].token_ids
