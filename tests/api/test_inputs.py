"""Bad input gives a clear error before any work starts, and the same LLM keeps working after it."""
import dataclasses
import json
import os
import shutil

import pytest

from pagedgen import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8)


def _assert_clean_and_working(llm: LLM, expected: list[int]) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    out = llm.generate(["Once upon a time"], GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == expected


@pytest.fixture(scope="module")
def expected(llm):
    return llm.generate(["Once upon a time"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize(
    "prompts, sampling_params, error, match",
    [
        (["ok", "word " * 600], GREEDY, ValueError, r"prompts\[1\] has \d+ tokens.*max_model_len=512"),
        ([[1, 2], [5] * 600], GREEDY, ValueError, r"prompts\[1\].*max_model_len"),
        (["a story", [1, 5, 6]], GREEDY, TypeError, r"prompts\[1\].*do not mix"),
        ([[1, 5], "a story"], GREEDY, TypeError, r"prompts\[1\].*do not mix"),
        ([[1, 5], [1, "x"]], GREEDY, TypeError, r"prompts\[1\]\[1\] must be an int token id, got str"),
        ([[1, 5], 7], GREEDY, TypeError, r"prompts\[1\] must be a list of int token ids, got int"),
        ([[1, 5], [1, 9999]], GREEDY, ValueError, r"prompts\[1\] has token id 9999 outside the vocabulary \[0, 512\)"),
        (123, GREEDY, TypeError, r"prompts must be"),
        (["a", "b"], [GREEDY], ValueError, r"sampling_params has 1 entries for 2 prompts"),
        (["a", "b"], [GREEDY, {"temperature": 0}], TypeError, r"sampling_params\[1\] must be a SamplingParams"),
        (["a"], {"temperature": 0}, TypeError, r"sampling_params must be"),
    ],
)
def test_bad_generate_input(llm, expected, prompts, sampling_params, error, match):
    with pytest.raises(error, match=match):
        llm.generate(prompts, sampling_params, use_tqdm=False)
    _assert_clean_and_working(llm, expected)


def test_text_tokenized_past_the_model_vocabulary_is_refused(llm, expected, monkeypatch):
    """A tokenizer may hold ids the model's embedding does not (added tokens): a text prompt that
    tokenizes to one is a ValueError naming the prompt before any work, not an IndexError mid-step."""
    ids = llm.tokenizer("a little dog")["input_ids"]
    monkeypatch.setattr(llm, "model_config", dataclasses.replace(llm.model_config, vocab_size=max(ids)))  # the largest id: one past it
    monkeypatch.setattr(llm.processor, "vocab_size", max(ids))
    with pytest.raises(ValueError, match=rf"prompts\[1\] \(as tokenized\) has token id {max(ids)} outside the vocabulary"):
        llm.generate(["a", "a little dog"], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"\(as tokenized\) has token id"):
        list(llm.generate_stream(iter(["a little dog"]), GREEDY))
    monkeypatch.undo()
    _assert_clean_and_working(llm, expected)


def test_empty_list_and_empty_prompt(llm, expected):
    assert llm.generate([], GREEDY) == []
    out = llm.generate([""], GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == [llm.tokenizer.bos_token_id]
    assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].text
    out_ids = llm.generate([[]], GREEDY, use_tqdm=False)[0]
    assert out_ids.prompt_token_ids == [llm.tokenizer.bos_token_id]
    _assert_clean_and_working(llm, expected)


@pytest.mark.in_process
def test_error_during_a_step_frees_everything(llm, expected, monkeypatch):
    runner = llm.llm_engine.model_runner
    real = runner.execute
    calls = {"n": 0}

    def failing(batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return real(batch)

    monkeypatch.setattr(runner, "execute", failing)
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate(["Once upon a time"] * 4, GREEDY, use_tqdm=False)
    monkeypatch.setattr(runner, "execute", real)
    _assert_clean_and_working(llm, expected)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(temperature=-0.5), ValueError, r"temperature must be in \[0, inf\)"),
        (dict(top_p=0.0), ValueError, r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), ValueError, r"top_p must be in \(0, 1\]"),
        (dict(top_k=-3), ValueError, r"top_k must be"),
        (dict(max_tokens=0), ValueError, r"max_tokens must be at least 1"),
        (dict(temperature="hot"), TypeError, r"temperature must be a number"),
        (dict(seed=1.5), TypeError, r"seed must be an int"),
        (dict(stop_token_ids=[-1]), ValueError, r"stop_token_ids must be non-negative"),
        (dict(stop_token_ids="2"), TypeError, r"stop_token_ids must be a list of int"),
        (dict(ignore_eos="yes"), TypeError, r"ignore_eos must be a bool"),
    ],
)
def test_bad_sampling_params(kwargs, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_match_vllm():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.seed, p.ignore_eos) == (1.0, 1.0, 0, 16, None, False)
    assert SamplingParams(top_k=-1).top_k == 0


def _copy_model(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return dst


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="model folder not found"):
        LLM(str(tmp_path / "nope"))


def test_missing_config(stories_path, tmp_path):
    path = _copy_model(stories_path, str(tmp_path / "m"))
    os.remove(os.path.join(path, "config.json"))
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        LLM(path)


def test_missing_weights(stories_path, tmp_path):
    path = _copy_model(stories_path, str(tmp_path / "m"))
    os.rename(os.path.join(path, "model.safetensors"), os.path.join(path, "pytorch_model.bin"))
    with pytest.raises(FileNotFoundError, match=r"weights are missing.*pytorch_model.bin.*only safetensors"):
        LLM(path)


def test_unsupported_architecture(stories_path, tmp_path):
    path = _copy_model(stories_path, str(tmp_path / "m"))
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["FalconForCausalLM"]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="unsupported architecture.*FalconForCausalLM.*supported: LlamaForCausalLM"):
        LLM(path)


# config.json edited so that it no longer describes the weights: a clear error at load time, not
# garbage output or a shape error in the middle of a generate call.
@pytest.mark.parametrize(
    "field, value, match",
    [
        ("hidden_size", 128, r"'model.embed_tokens.weight' has shape \(512, 64\), but config.json implies \(512, 128\)"),
        ("intermediate_size", 100, r"'model.layers.0.mlp.gate_proj.weight' has shape \(172, 64\).*\(100, 64\)"),
        ("num_key_value_heads", 8, r"'model.layers.0.self_attn.k_proj.weight' has shape \(32, 64\).*\(64, 64\)"),
        ("vocab_size", 1024, r"'model.embed_tokens.weight' has shape \(512, 64\).*\(1024, 64\)"),
        ("num_hidden_layers", 3, "holds 5 decoder layers, but config.json says num_hidden_layers=3"),
    ],
)
def test_config_that_does_not_match_the_weights(stories_path, tmp_path, field, value, match):
    path = _copy_model(stories_path, str(tmp_path / "m"))
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg[field] = value
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match=match):
        LLM(path)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(block_size=0), ValueError, "block_size must be >= 1"),
        (dict(max_num_seqs="8"), TypeError, "max_num_seqs must be an int"),
        (dict(max_model_len=4096), ValueError, "max_model_len must be <= .*512"),
        (dict(dtype="int8"), ValueError, "dtype must be one of"),
        (dict(kv_cache_memory_bytes=10), ValueError, "kv_cache_memory_bytes must hold at least one block"),
        (dict(device="tpu"), ValueError, "device must be 'cpu', 'cuda' or 'cuda:N'"),
        (dict(gpu_memory_utilization=1.5), ValueError, r"gpu_memory_utilization must be in \(0, 1\]"),
        (dict(preemption_mode="pause"), ValueError, "preemption_mode must be 'recompute' or 'swap'"),
    ],
)
def test_bad_llm_arguments(stories_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        LLM(stories_path, **kwargs)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_cuda_without_gpu_is_a_clear_error(stories_path):
    with pytest.raises(ValueError, match="torch sees no CUDA GPU"):
        LLM(stories_path, device="cuda")


def test_sharded_checkpoint_loads(stories_path, tmp_path, expected):
    """A model.safetensors.index.json with two shards gives the same output as one file."""
    from safetensors.torch import load_file, save_file

    path = _copy_model(stories_path, str(tmp_path / "m"))
    tensors = load_file(os.path.join(path, "model.safetensors"))
    os.remove(os.path.join(path, "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, os.path.join(path, shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in keys})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    llm = LLM(path, num_kv_blocks=64)
    assert llm.generate(["Once upon a time"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected


def test_progress_bar_counts_finished_requests(llm, capsys):
    """The tqdm bar counts requests (all n completions done) and shows output tokens/s."""
    llm.generate(["Once upon a time", "The dog"], SamplingParams(n=3, max_tokens=8, seed=1), use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts: 100%" in err and "2/2" in err and "tok/s" in err


def _mutated(**fields):
    sp = SamplingParams(max_tokens=5)
    for k, v in fields.items():
        setattr(sp, k, v)
    return sp


@pytest.mark.parametrize(
    "fields, error, match",
    [
        (dict(seed=2**70), ValueError, r"sampling_params\[1\]: SamplingParams.seed must be a 64-bit integer"),
        (dict(logit_bias={-1: 100.0}), ValueError, r"sampling_params\[1\]: SamplingParams.logit_bias must be keyed by non-negative"),
        (dict(n=0), ValueError, r"sampling_params\[1\]: SamplingParams.n"),
        (dict(n="3"), TypeError, r"sampling_params\[1\]: SamplingParams.n must be an int"),
        (dict(max_tokens=0), ValueError, r"sampling_params\[1\]: SamplingParams.max_tokens"),
        (dict(stop_token_ids=[600]), ValueError, r"sampling_params\[1\].stop_token_ids has token id 600 outside the vocabulary"),
    ],
)
def test_params_changed_after_construction_are_checked_before_work(llm, expected, fields, error, match):
    with pytest.raises(error, match=match):
        llm.generate(["Once upon a time", "The dog"], [GREEDY, _mutated(**fields)], use_tqdm=False)
    _assert_clean_and_working(llm, expected)


def test_stop_set_to_a_str_after_construction_is_one_stop_string(llm):
    sp = SamplingParams(temperature=0, max_tokens=30)
    sp.stop = "girl"
    text = llm.generate(["Once upon a time"], sp, use_tqdm=False)[0].outputs[0]
    assert text.stop_reason == "girl" and "girl" not in text.text and text.text  # not a stop at every character


def test_token_id_prompts(llm, expected):
    import numpy as np

    ids = llm.tokenizer("Once upon a time").input_ids
    out = llm.generate([np.array(ids, dtype=np.int64).tolist(), [np.int64(t) for t in ids]], GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == out[1].outputs[0].token_ids == expected
    with pytest.raises(TypeError, match=r"prompts\[0\]\[1\] must be an int token id, got float 2.0"):
        llm.generate([[1, 2.0]], GREEDY)
    with pytest.raises(TypeError, match=r"prompts\[0\]\[0\] must be an int token id, got bool"):
        llm.generate([[True, 5]], GREEDY)
    with pytest.raises(TypeError, match="use_tqdm must be a bool"):
        llm.generate(["a"], GREEDY, use_tqdm="no")
    _assert_clean_and_working(llm, expected)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(seed=2**70), ValueError, "LLM seed must be a 64-bit integer"),
        (dict(gpu_memory_utilization="abc"), TypeError, "gpu_memory_utilization must be a number"),
        (dict(tokenizer="/nonexistent"), FileNotFoundError, "tokenizer folder not found"),
        (dict(tokenizer=5), TypeError, "tokenizer must be a folder path"),
        (dict(enforce_extension="yes"), TypeError, "enforce_extension must be a bool"),
        (dict(block_size=10**6), ValueError, r"block_size must be in \[1, 1024\]"),
    ],
)
def test_more_bad_llm_arguments(stories_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        LLM(stories_path, **kwargs)


def test_numpy_ints_are_ints_for_llm_beam_search_and_streams(stories_path, llm, expected):
    """A value read from an array or a data frame (numpy's ints and floats) is taken as the Python
    number it is: LLM's int arguments (tensor_parallel_size among them), gpu_memory_utilization,
    BeamSearchParams' ints, generate_stream's max_in_flight; a bool or a float is still refused."""
    import numpy as np

    from pagedgen import BeamSearchParams

    other = LLM(stories_path, num_kv_blocks=np.int64(256), max_num_seqs=np.int32(8), block_size=np.int64(16), seed=np.uint64(0),
                tensor_parallel_size=np.int64(1), pipeline_parallel_size=np.int8(1), max_model_len=np.int64(256),
                gpu_memory_utilization=np.float32(0.5))
    assert other.cache_config.num_blocks == 256 and type(other.cache_config.block_size) is int and type(other.scheduler_config.max_num_seqs) is int
    assert type(other.seed) is int and other.scheduler_config.max_model_len == 256
    assert other.generate(["Once upon a time"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected
    params = BeamSearchParams(beam_width=np.int64(2), max_tokens=np.int32(4))
    assert (type(params.beam_width), type(params.max_tokens)) == (int, int)
    outs = list(other.generate_stream(["Once upon a time"] * 3, GREEDY, max_in_flight=np.int64(2)))
    assert [o.outputs[0].token_ids for o in outs] == [expected] * 3
    with pytest.raises(TypeError, match="LLM tensor_parallel_size must be an int, got float"):
        LLM(stories_path, tensor_parallel_size=np.float64(1.0))
    with pytest.raises(TypeError, match="LLM max_num_seqs must be an int, got bool"):
        LLM(stories_path, max_num_seqs=np.bool_(True))
    with pytest.raises(TypeError, match="BeamSearchParams.beam_width must be an int, got float"):
        BeamSearchParams(beam_width=np.float32(2), max_tokens=4)
