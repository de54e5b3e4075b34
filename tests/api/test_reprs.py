"""Short reprs of RequestOutput, CompletionOutput, SamplingParams and EngineStats (issue 16)."""
import pytest

from pagedgen import CompletionOutput, RequestOutput, SamplingParams
from pagedgen.outputs import Logprob


def _completion(i: int = 0, n_tokens: int = 1000, text_len: int = 5000) -> CompletionOutput:
    return CompletionOutput(index=i, text="x" * text_len, token_ids=list(range(n_tokens)), cumulative_logprob=-12.3456789,
                            logprobs=[{t: Logprob(-0.5, 1)} for t in range(n_tokens)], finish_reason="length")


def test_completion_output_repr_is_short():
    r = repr(_completion())
    assert r.startswith("CompletionOutput(index=0, text='xxxx") and len(r) < 300
    assert "(5,000 chars)" in r and "[0, 1, 2, 3, 4, 5, 6, 7, …, 998, 999] (1,000 tokens)" in r
    assert "cumulative_logprob=-12.35" in r and "logprobs=<1000 positions, up to 1 tokens each>" in r
    assert "finish_reason='length'" in r and "stop_reason" not in r
    short = CompletionOutput(index=1, text="hi", token_ids=[5, 6], finish_reason="stop", stop_reason=2)
    assert repr(short) == "CompletionOutput(index=1, text='hi', token_ids=[5, 6], finish_reason='stop', stop_reason=2)"


def test_request_output_repr_and_pretty():
    pretty = pytest.importorskip("IPython.lib.pretty").pretty
    out = RequestOutput(request_id="3", prompt="p" * 300, prompt_token_ids=list(range(300)),
                        outputs=[_completion(0), _completion(1, 3, 4)], finished=True, num_cached_tokens=32)
    r = repr(out)
    assert r.startswith("RequestOutput(request_id='3', prompt='pppp") and "(300 chars)" in r and "(300 tokens)" in r
    assert "CompletionOutput(index=0" in r and "CompletionOutput(index=1, text='xxxx', token_ids=[0, 1, 2]" in r
    assert r.endswith("finished=True, num_cached_tokens=32)") and len(r) < 800
    lines = pretty(out).splitlines()
    assert len(lines) > 5 and max(map(len, lines)) < 160
    assert lines[0] == "RequestOutput(request_id='3',"
    assert any(line.strip().startswith("outputs=[CompletionOutput(index=0,") for line in lines)
    assert pretty([out, out]).count("RequestOutput(") == 2


def test_sampling_params_repr_shows_what_was_set():
    assert repr(SamplingParams()) == "SamplingParams(temperature=1.0, max_tokens=16)"
    sp = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=128, n=2, seed=7, stop=["\n\n"], logprobs=3)
    assert repr(sp) == ("SamplingParams(n=2, temperature=0.8, top_p=0.95, seed=7, stop=['\\n\\n'], max_tokens=128, logprobs=3)")
    assert eval(repr(sp), {"SamplingParams": SamplingParams}) == sp
    long = SamplingParams(stop_token_ids=list(range(100)), logit_bias={i: 1.0 for i in range(50)})
    assert "(100 tokens)" in repr(long) and "(50 entries)" in repr(long) and len(repr(long)) < 300


def test_engine_stats_repr(llm):
    llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    s = llm.get_stats()
    r = repr(s)
    assert r.startswith(f"EngineStats(num_steps={s.num_steps}, num_preemptions={s.num_preemptions}, ")
    assert f"kv_utilization_mean={s.kv_utilization_mean:.4g}" in r and f"num_kv_blocks={s.num_kv_blocks}" in r
    assert ("num_swaps_out" in r) == bool(s.num_swaps_out)  # zero extras are left out
    assert len(r) < 500


def test_engine_stats_repr_always_shows_prefix_cache_and_sharing():
    import dataclasses

    from pagedgen.engine.stats import EngineStats

    zero = EngineStats(**{f.name: 0.0 if f.type == "float" else 0 for f in dataclasses.fields(EngineStats)})
    r = repr(zero)  # a run without hits or sharing: the figures say 0, they are not left out
    assert "prefix_cache_hit_rate=0, sharing_savings_mean=0, peak_sharing_savings=0" in r
    assert "num_cached_tokens" not in r and "num_copy_on_write" not in r
    shared = dataclasses.replace(zero, prefix_cache_hit_rate=0.25, num_cached_tokens=48, sharing_savings_mean=0.125,
                                 peak_sharing_savings=0.5, num_copy_on_write=3)
    r = repr(shared)
    assert "prefix_cache_hit_rate=0.25, sharing_savings_mean=0.125, peak_sharing_savings=0.5" in r
    assert "num_cached_tokens=48" in r and "num_copy_on_write=3" in r
