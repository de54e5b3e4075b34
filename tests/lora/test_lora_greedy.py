"""Multi-LoRA end to end: three PEFT adapters (ranks 4, 8, 16; attention, MLP and all seven
projections; safetensors and .bin; rslora) and the base model mixed in one call, against
transformers with PEFT's ``merge_and_unload()`` (fp32, stories260K): greedy tokens equal, logprobs
within 1e-4. Then the same outputs through prefix caching, recompute and swap preemption, n > 1,
one slot for three adapters, beam search, the request-level engine and a stream; a request's bits
do not depend on its batch."""
import os

import pytest

import lora_adapters as la
from conftest import ROOT, story_openings
from pagedgen import LLM, LoRARequest, SamplingParams

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def adapters(stories_path, tmp_path_factory, one_torch_thread):
    root = tmp_path_factory.mktemp("loras")
    return [
        None,
        LoRARequest("attn", 1, la.make_adapter(stories_path, str(root / "attn"), r=8, targets=("q_proj", "k_proj", "v_proj", "o_proj"), seed=1, std=0.1)),
        LoRARequest("mlp", 2, la.make_adapter(stories_path, str(root / "mlp"), r=4, alpha=4, targets=("gate_proj", "up_proj", "down_proj"), seed=2, std=0.1)),
        LoRARequest("all", 3, la.make_adapter(stories_path, str(root / "all"), r=16, alpha=8, seed=3, std=0.1, use_rslora=True, safe_serialization=False,
                                              targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))),
    ]


@pytest.fixture(scope="module")
def prompts():
    return story_openings(64, seed=48)  # the validation split: held out


@pytest.fixture(scope="module")
def reference(stories_path, adapters, prompts):
    """{(prompt index, adapter index): (tokens, logprobs)} of transformers with the merged adapter."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stories_path)
    models = [la.merged_model(stories_path, None if a is None else a.lora_path) for a in adapters]
    return {(i, i % 4): la.greedy(models[i % 4], tok(p)["input_ids"], MAX_TOKENS) for i, p in enumerate(prompts)}


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def mixed(stories_path, adapters, prompts):
    llm = LLM(stories_path, enable_lora=True, max_loras=3, max_cpu_loras=3)
    outs = llm.generate(prompts, GREEDY, lora_request=[adapters[i % 4] for i in range(len(prompts))], use_tqdm=False)
    return llm, outs


def test_mixed_adapters_match_transformers_with_merged_peft_adapters(mixed, reference):
    _, outs = mixed
    for i, out in enumerate(outs):
        ref_tokens, ref_logprobs = reference[(i, i % 4)]
        comp = out.outputs[0]
        assert comp.token_ids == ref_tokens, (i, i % 4)
        mine = [comp.logprobs[j][t].logprob for j, t in enumerate(comp.token_ids)]
        assert max(abs(a - b) for a, b in zip(mine, ref_logprobs)) < 1e-4, (i, i % 4)


def test_adapters_change_outputs_and_none_is_the_base_model(stories_path, mixed, prompts, adapters):
    llm, outs = mixed
    base = llm.generate(prompts, GREEDY, use_tqdm=False)  # lora_request None: the base model
    plain = LLM(stories_path).generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(base) == _tokens(plain)
    differ = [i for i in range(len(prompts)) if i % 4 and outs[i].outputs[0].token_ids != base[i].outputs[0].token_ids]
    assert len(differ) >= 36, differ  # of the 48 adapter prompts
    assert all(outs[i].outputs[0].token_ids == base[i].outputs[0].token_ids for i in range(0, len(prompts), 4))


@pytest.fixture(scope="module")
def shifted(mixed, adapters, prompts):
    """Prompts 0-15 under the next adapter (the base model's prompts under "attn", and so on)."""
    llm, _ = mixed
    return _tokens(llm.generate(prompts[:16], GREEDY, lora_request=[adapters[(i + 1) % 4] for i in range(16)], use_tqdm=False))


@pytest.mark.parametrize("kwargs", [
    dict(enable_prefix_caching=True, max_loras=3),
    dict(num_kv_blocks=12, max_model_len=128, max_num_seqs=16, max_loras=2),  # recompute preemption, 2 slots for 3 adapters
    dict(num_kv_blocks=12, max_model_len=128, max_num_seqs=16, preemption_mode="swap", max_loras=3),
    dict(max_loras=1, max_cpu_loras=1),  # one slot, one host entry: adapters reloaded from disk
    dict(max_loras=1, max_cpu_loras=3),  # one slot, every adapter kept in host memory: read from disk once
], ids=["prefix-cache", "recompute", "swap", "one-slot", "one-slot-host-cache"])
def test_same_outputs_through_the_engine_paths(stories_path, mixed, shifted, adapters, prompts, kwargs):
    _, outs = mixed
    llm = LLM(stories_path, enable_lora=True, **kwargs)
    loras = [adapters[i % 4] for i in range(len(prompts))]
    # prompts 0-15 again, each under the next adapter: with prefix caching they find no block of
    # their first run (another adapter), and each equals its run under that adapter
    got = llm.generate(prompts + prompts[:16], GREEDY, lora_request=loras + [adapters[(i + 1) % 4] for i in range(16)], use_tqdm=False)
    assert _tokens(got[:64]) == _tokens(outs)
    assert [o.outputs[0].logprobs for o in got[:64]] == [o.outputs[0].logprobs for o in outs]
    assert _tokens(got[64:]) == shifted
    stats = llm.get_stats()
    if "num_kv_blocks" in kwargs:
        assert stats.num_preemptions > 0
    if kwargs.get("preemption_mode") == "swap":
        assert stats.num_swaps_out > 0
    runner = llm.llm_engine.model_runner
    if kwargs.get("max_loras") == 1:
        assert runner.lora.num_slot_loads > 3  # the one slot's adapter replaced again and again
        if kwargs["max_cpu_loras"] == 1:
            assert runner.lora.num_disk_loads > 3  # evicted from the one host entry and read again
        else:
            assert runner.lora.num_disk_loads == 3


def test_prefix_cache_never_crosses_adapters(stories_path, adapters):
    llm = LLM(stories_path, enable_lora=True, max_loras=3, enable_prefix_caching=True, block_size=4)
    prompt = "Once upon a time there was a little girl named Lily who loved to play outside"
    for lora in adapters:
        fresh = LLM(stories_path, enable_lora=True, enable_prefix_caching=False).generate([prompt], GREEDY, lora_request=lora, use_tqdm=False)
        out = llm.generate([prompt], GREEDY, lora_request=lora, use_tqdm=False)
        assert out[0].num_cached_tokens == 0  # the prompt ran before, but under another adapter
        assert out[0].outputs[0].token_ids == fresh[0].outputs[0].token_ids
        again = llm.generate([prompt], GREEDY, lora_request=lora, use_tqdm=False)
        assert again[0].num_cached_tokens > 0 and again[0].outputs[0].token_ids == fresh[0].outputs[0].token_ids


def test_parallel_samples_beams_engine_and_stream(stories_path, mixed, adapters, prompts):
    llm, outs = mixed
    lora = adapters[3]
    n = llm.generate(prompts[3:4], SamplingParams(n=3, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), lora_request=lora, use_tqdm=False)
    assert [c.token_ids for c in n[0].outputs] == [outs[3].outputs[0].token_ids] * 3
    seeded = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=MAX_TOKENS)
    a = llm.generate(prompts[:2], seeded, lora_request=[lora, None], use_tqdm=False)
    b = llm.generate(prompts[:2], seeded, lora_request=[lora, None], use_tqdm=False)
    assert _tokens(a) == _tokens(b)
    assert _tokens(a)[0] != _tokens(llm.generate(prompts[:1], seeded, use_tqdm=False))[0]
    streamed = {o.index: o.outputs[0].token_ids for o in llm.generate_stream(prompts[3:64:4], GREEDY, lora_request=lora)}
    assert [streamed[k] for k in range(16)] == [outs[i].outputs[0].token_ids for i in range(3, 64, 4)]
    engine = llm.llm_engine
    engine.add_request("x", prompts[1], GREEDY, lora_request=adapters[1])
    engine.add_request("y", prompts[2], GREEDY, lora_request=adapters[2])
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step()})
    assert done == {"x": outs[1].outputs[0].token_ids, "y": outs[2].outputs[0].token_ids}
    from pagedgen import BeamSearchParams

    template = open(os.path.join(ROOT, "examples", "chat_template.jinja")).read()
    chat = llm.chat([{"role": "user", "content": prompts[7]}], GREEDY, chat_template=template, lora_request=adapters[2], use_tqdm=False)[0]
    again = llm.generate([chat.prompt_token_ids], GREEDY, lora_request=adapters[2], use_tqdm=False)[0]
    plain = llm.generate([chat.prompt_token_ids], GREEDY, use_tqdm=False)[0]
    assert chat.outputs[0].token_ids == again.outputs[0].token_ids != plain.outputs[0].token_ids
    beams = llm.beam_search([prompts[5]], BeamSearchParams(beam_width=1, max_tokens=MAX_TOKENS, ignore_eos=True), lora_request=adapters[1])
    assert beams[0].sequences[0].output_token_ids == outs[5].outputs[0].token_ids  # beam width 1: greedy


def test_a_request_does_not_depend_on_its_batch(stories_path, mixed, adapters, prompts):
    """Batch invariance: each request alone gives the bits it gave in the mixed 64-prompt batch."""
    llm, outs = mixed
    for i in (1, 2, 3, 6, 11):
        alone = llm.generate([prompts[i]], GREEDY, lora_request=adapters[i % 4], use_tqdm=False)[0].outputs[0]
        assert alone.token_ids == outs[i].outputs[0].token_ids
        assert alone.logprobs == outs[i].outputs[0].logprobs


@pytest.mark.parametrize("kwargs", [dict(distributed_executor_backend="pickle"), dict(tensor_parallel_size=2, num_kv_blocks=24, max_model_len=192)],
                         ids=["pickled-boundary", "tp2-preemption"])
def test_through_worker_processes_and_tensor_parallelism(stories_path, mixed, adapters, prompts, kwargs):
    """The step records carry each sequence's adapter; under TP = 2 each rank holds its shard of A
    or B (column-parallel: B's rows, row-parallel: A's columns, the all-reduce summing the shrink)."""
    _, outs = mixed
    with LLM(stories_path, enable_lora=True, max_loras=3, **kwargs) as llm:
        got = llm.generate(prompts, GREEDY, lora_request=[adapters[i % 4] for i in range(len(prompts))], use_tqdm=False)
        if "tensor_parallel_size" in kwargs:
            assert len(llm.llm_engine.executor.worker_pids) == 2 and llm.get_stats().num_preemptions > 0
    assert _tokens(got) == _tokens(outs)
    for a, b in zip(got, outs):
        mine, ref = a.outputs[0], b.outputs[0]
        diffs = [abs(x[t].logprob - y[t].logprob) for x, y, t in zip(mine.logprobs, ref.logprobs, mine.token_ids)]
        assert max(diffs) < 1e-4 if "tensor_parallel_size" in kwargs else max(diffs) == 0.0


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_with_adapters(stories_path, mixed, adapters, prompts, method):
    """Drafts (n-gram lookup, or the base model as the draft model) are verified by the target with
    each request's adapter: greedy tokens equal speculation off."""
    _, outs = mixed
    config = {"method": method, "num_speculative_tokens": 3, **({"prompt_lookup_min": 1} if method == "ngram" else {"model": stories_path})}
    llm = LLM(stories_path, enable_lora=True, max_loras=3, speculative_config=config)
    got = llm.generate(prompts[:32], GREEDY, lora_request=[adapters[i % 4] for i in range(32)], use_tqdm=False)
    assert _tokens(got) == _tokens(outs[:32])
    assert llm.get_stats().num_accepted_tokens > 0
