"""Checkpoint loading: streaming memory bound, sharded checkpoints, and a clear error naming the file
or the field for every broken checkpoint (issue 12 item 5, issue 15 item 4)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import tiny_checkpoints
from conftest import ROOT
from pagedgen import LLM, SamplingParams
from pagedgen.model import loader
from pagedgen.model.loader import CheckpointError


def _copy(src: str, dst) -> str:
    shutil.copytree(src, str(dst))
    return str(dst)


def _edit_config(path: str, **changes) -> None:
    file = os.path.join(path, "config.json")
    with open(file) as f:
        cfg = json.load(f)
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    with open(file, "w") as f:
        json.dump(cfg, f)


def _load(path: str, dtype=torch.float32):
    hf_config = loader.load_hf_config(path)
    return loader.load_model(path, hf_config, loader.model_config_from_hf(hf_config, dtype))


# ----- streaming: memory ---------------------------------------------------------------------------

_MEASURE = textwrap.dedent(
    """
    import json, sys, torch
    from pagedgen.model import loader

    def status():
        return {l.split(":")[0]: int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(("VmRSS", "VmHWM"))}

    def load(path):
        hf_config = loader.load_hf_config(path)
        return loader.load_model(path, hf_config, loader.model_config_from_hf(hf_config, torch.bfloat16))

    warm_up, path = sys.argv[1:]
    load(warm_up)  # a tiny model of the same family first: the code it imports is not the load's memory
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    base = status()["VmRSS"]
    model = load(path)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"base": base, "peak": status()["VmHWM"], "weights": weights}))
    """
)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs to reset the peak RSS")
def test_peak_rss_while_loading_is_within_1_2x_the_weights(stories_path, tmp_path):
    """A float32 checkpoint of ~90 MB loaded as bfloat16 (~45 MB): the peak resident memory of the
    load (RSS, so torch storages and memory-mapped pages count) stays within 1.2x the weights."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    path = str(tmp_path / "m")
    config = LlamaConfig(
        vocab_size=4096, hidden_size=512, intermediate_size=1376, num_hidden_layers=6, num_attention_heads=8,
        num_key_value_heads=8, max_position_embeddings=512, architectures=["LlamaForCausalLM"],
    )
    config.save_pretrained(path)
    gen = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(4096, 512, generator=gen), "lm_head.weight": torch.randn(4096, 512, generator=gen), "model.norm.weight": torch.ones(512)}
    for i in range(6):
        p = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj", (512, 512)), ("self_attn.k_proj", (512, 512)), ("self_attn.v_proj", (512, 512)), ("self_attn.o_proj", (512, 512)),
                            ("mlp.gate_proj", (1376, 512)), ("mlp.up_proj", (1376, 512)), ("mlp.down_proj", (512, 1376))):
            tensors[p + name + ".weight"] = torch.randn(*shape, generator=gen)
        tensors[p + "input_layernorm.weight"] = tensors[p + "post_attention_layernorm.weight"] = torch.ones(512)
    save_file({k: v.clone() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    file_bytes = os.path.getsize(os.path.join(path, "model.safetensors"))
    del tensors
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _MEASURE, stories_path, path], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["weights"] == pytest.approx(file_bytes / 2, rel=0.01)  # float32 on disk, bfloat16 in memory
    assert m["peak"] - m["base"] <= 1.2 * m["weights"], m


# ----- sharded checkpoints, tied embeddings ----------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "qwen2"])  # qwen2's entry ties the embeddings
def test_sharded_checkpoint_equals_the_single_file(name, tmp_path):
    hf_model = tiny_checkpoints.build(name, str(tmp_path / "single"))
    hf_model.save_pretrained(str(tmp_path / "sharded"), max_shard_size="200KB")
    shards = [f for f in os.listdir(tmp_path / "sharded") if f.endswith(".safetensors")]
    assert len(shards) > 2 and os.path.isfile(tmp_path / "sharded" / "model.safetensors.index.json")
    single, sharded = _load(str(tmp_path / "single")), _load(str(tmp_path / "sharded"))
    a, b = dict(single.named_parameters()), dict(sharded.named_parameters())
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    head, embed = sharded.lm_head.weight, sharded.model.embed_tokens.weight
    assert (head is embed) == single.config.tie_word_embeddings


# ----- broken checkpoints: a clear error naming the file (issue 15 item 4) ---------------------------


@pytest.fixture
def model_copy(stories_path, tmp_path):
    return _copy(stories_path, tmp_path / "m")


def _truncate(path: str) -> None:
    file = os.path.join(path, "model.safetensors")
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) // 2)


def _garbage(path: str) -> None:
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(os.urandom(50_000))


def _not_json(path: str) -> None:
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write('{"architectures": ["LlamaForCausalLM"], ')


def _no_tokenizer(path: str) -> None:
    for f in os.listdir(path):
        if f.startswith("tokenizer"):
            os.remove(os.path.join(path, f))


def _shard_missing(path: str) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(os.path.join(path, "model.safetensors"))
    os.remove(os.path.join(path, "model.safetensors"))
    names = sorted(tensors)
    weight_map = {n: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, n in enumerate(names)}
    save_file({n: tensors[n] for n in names if weight_map[n].startswith("model-00001")}, os.path.join(path, "model-00001-of-00002.safetensors"))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def _index_not_json(path: str) -> None:
    os.rename(os.path.join(path, "model.safetensors"), os.path.join(path, "model-00001-of-00001.safetensors"))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        f.write("weight_map: model-00001-of-00001.safetensors")


@pytest.mark.parametrize(
    "breakage, error, file, match",
    [
        (_truncate, CheckpointError, "model.safetensors", "not a readable safetensors file, truncated or corrupt"),
        (_garbage, CheckpointError, "model.safetensors", "not a readable safetensors file, truncated or corrupt"),
        (_not_json, CheckpointError, "config.json", "is not valid JSON"),
        (lambda p: _edit_config(p, hidden_size=None), CheckpointError, "config.json", "required field hidden_size is missing"),
        (lambda p: _edit_config(p, num_hidden_layers=None), CheckpointError, "config.json", "required field num_hidden_layers is missing"),
        (_no_tokenizer, FileNotFoundError, "", "no tokenizer files in .*expected one of tokenizer.json"),
        (_shard_missing, FileNotFoundError, "model-00002-of-00002.safetensors", r"listed in .*model.safetensors.index.json is missing"),
        (_index_not_json, CheckpointError, "model.safetensors.index.json", "is not valid JSON"),
    ],
    ids=["truncated", "random-bytes", "config-not-json", "no-hidden-size", "no-num-layers", "no-tokenizer", "shard-missing", "index-not-json"],
)
def test_broken_checkpoint_is_a_clear_error_naming_the_file(model_copy, breakage, error, file, match):
    breakage(model_copy)
    with pytest.raises(error, match=match) as info:
        LLM(model_copy)
    assert os.path.join(model_copy, file).rstrip("/") in str(info.value)
    assert isinstance(info.value, (ValueError, OSError))


def test_tokenizer_from_another_folder_fixes_a_folder_without_one(model_copy, stories_path):
    _no_tokenizer(model_copy)
    llm = LLM(model_copy, tokenizer=stories_path, num_kv_blocks=16, max_model_len=256)
    assert llm.generate(["Once"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


# ----- configs and weights the model cannot honour: errors naming the field ----------------------------


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(architectures=["FalconForCausalLM"]), r"unsupported architecture \['FalconForCausalLM'\].*supported: LlamaForCausalLM, MistralForCausalLM.*GPTNeoXForCausalLM"),
        (dict(architectures=None), "config.json has no architectures field"),
        (dict(architectures=["GPT2LMHeadModel"]), "architectures=\\['GPT2LMHeadModel'\\] needs model_type='gpt2', got model_type='llama'"),
        (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}), r"rope_parameters.rope_type='dynamic' is not supported \(its frequencies change with the sequence length\); supported: default, linear"),
        (dict(hidden_act="softsign"), "hidden_act='softsign' is not supported; supported: silu"),
    ],
    ids=["architecture", "no-architectures", "architecture-vs-model-type", "rope-type", "activation"],
)
def test_config_the_model_cannot_honour(model_copy, changes, match):
    _edit_config(model_copy, **changes)
    with pytest.raises(ValueError, match=match):
        LLM(model_copy)


def _rewrite_weights(path: str, edit) -> None:
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda t: t.pop("model.layers.2.self_attn.v_proj.weight"), r"weight 'model.layers.2.self_attn.v_proj.weight' is missing from the checkpoint"),
        (lambda t: t.update({"model.layers.0.mlp.fc1.weight": torch.zeros(4, 4)}), r"tensor 'model.layers.0.mlp.fc1.weight' is not a weight of LlamaForCausalLM"),
        (lambda t: t.update({"model.norm.weight": torch.zeros(64, dtype=torch.int32)}), "has dtype I32; only floating-point"),
        (lambda t: t.update({"model.norm.weight": torch.zeros(65)}), r"weight 'model.norm.weight' has shape \(65,\), but config.json implies \(64,\) \(hidden_size=64"),
    ],
    ids=["missing", "unexpected", "int-dtype", "norm-shape"],
)
def test_weights_that_do_not_match_the_config(model_copy, edit, match):
    _rewrite_weights(model_copy, edit)
    with pytest.raises(ValueError, match=match):
        LLM(model_copy)
