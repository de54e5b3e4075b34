"""Bad LoRA input is a ValueError / TypeError naming the adapter and the request, raised before any
work, and the LLM stays usable: a missing folder, an adapter of another base model, a rank over
``max_lora_rank``, a target module LoRA does not run (lm_head, embeddings, modules_to_save), one
``lora_int_id`` with two paths, ``lora_request`` without ``enable_lora``; and the ``LLM`` arguments."""
import json
import os
import shutil

import pytest

import lora_adapters as la
import tiny_checkpoints
from pagedgen import LLM, LoRARequest, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4)
PROMPTS = ["Once upon a time", "The little dog", "Lily was"]


@pytest.fixture(scope="module")
def folders(stories_path, tmp_path_factory, one_torch_thread):
    root = tmp_path_factory.mktemp("bad-loras")
    other = str(root / "other-base")
    tiny_checkpoints.build("llama", other, hidden_size=128)  # another base model: its hidden size differs from stories260K's 64
    made = {
        "good": la.make_adapter(stories_path, str(root / "good"), r=8),
        "good2": la.make_adapter(stories_path, str(root / "good2"), r=4, seed=5),
        "rank32": la.make_adapter(stories_path, str(root / "rank32"), r=32),
        "other": la.make_adapter(other, str(root / "other")),
        "lm_head": la.make_adapter(stories_path, str(root / "lm_head"), targets=("q_proj", "lm_head")),
        "embed": la.make_adapter(stories_path, str(root / "embed"), targets=("embed_tokens",)),
        "save": la.make_adapter(stories_path, str(root / "save"), modules_to_save=["lm_head"]),
    }
    no_weights = str(root / "no-weights")
    shutil.copytree(made["good"], no_weights)
    os.remove(os.path.join(no_weights, "adapter_model.safetensors"))
    made["no_weights"] = no_weights
    made["missing"] = str(root / "missing")
    return made


@pytest.fixture(scope="module")
def lora_llm(stories_path):
    return LLM(stories_path, enable_lora=True, max_loras=2, max_lora_rank=16)


@pytest.mark.parametrize("name, match", [
    ("missing", "folder not found"),
    ("no_weights", "no adapter_model.safetensors or adapter_model.bin"),
    ("other", r"shape \[.*\], the model needs"),
    ("rank32", "rank r=32 is over max_lora_rank=16"),
    ("lm_head", r"target_modules \['lm_head'\] not supported"),
    ("embed", r"target_modules \['embed_tokens'\] not supported"),
    ("save", "modules_to_save"),
])
def test_a_bad_adapter_names_itself_and_the_request_before_any_work(lora_llm, folders, name, match):
    engine = lora_llm.llm_engine
    steps = engine.scheduler.stats.num_steps
    bad = LoRARequest(f"bad-{name}", 7, folders[name])
    with pytest.raises(ValueError, match=match) as info:
        lora_llm.generate(PROMPTS, GREEDY, lora_request=[None, None, bad], use_tqdm=False)
    message = str(info.value)
    assert "prompts[2]" in message and f"'bad-{name}'" in message and "lora_int_id=7" in message
    assert engine.scheduler.stats.num_steps == steps and not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match=match):  # one for all prompts: named with their range
        lora_llm.generate(PROMPTS, GREEDY, lora_request=bad, use_tqdm=False)
    with pytest.raises(ValueError, match=match):
        engine.add_request("r", PROMPTS[0], GREEDY, lora_request=bad)
    assert not engine.has_unfinished_requests()
    good = LoRARequest("good", 1, folders["good"])
    assert len(lora_llm.generate(PROMPTS, GREEDY, lora_request=good, use_tqdm=False)) == 3  # still usable


def test_one_id_two_paths_is_refused_in_a_call_and_across_calls(lora_llm, folders):
    a, b = LoRARequest("a", 3, folders["good"]), LoRARequest("b", 3, folders["good2"])
    with pytest.raises(ValueError, match=r"prompts\[1\] lora_request 'b': lora_int_id 3 has path .* at prompts\[0\]; one id, one adapter"):
        lora_llm.generate(PROMPTS[:2], GREEDY, lora_request=[a, b], use_tqdm=False)
    lora_llm.generate(PROMPTS[:1], GREEDY, lora_request=a, use_tqdm=False)  # the refused call bound nothing: id 3 is free
    with pytest.raises(ValueError, match="lora_int_id 3 was already given path"):
        lora_llm.generate(PROMPTS[:1], GREEDY, lora_request=b, use_tqdm=False)
    with pytest.raises(ValueError, match="lora_int_id 3 was already given path"):
        lora_llm.llm_engine.add_request("x", PROMPTS[0], GREEDY, lora_request=b)


def test_lora_request_without_enable_lora(stories_path, folders):
    llm = LLM(stories_path)
    with pytest.raises(ValueError, match=r"prompts\[0\] lora_request 'good' .*LoRA is off; make the LLM with LLM\(..., enable_lora=True\)"):
        llm.generate(PROMPTS, GREEDY, lora_request=[LoRARequest("good", 1, folders["good"]), None, None], use_tqdm=False)
    assert len(llm.generate(PROMPTS, GREEDY, lora_request=None, use_tqdm=False)) == 3


def test_bad_types_and_counts(lora_llm, folders):
    good = LoRARequest("good", 1, folders["good"])
    with pytest.raises(ValueError, match=r"one per prompt \(3\), got 2"):
        lora_llm.generate(PROMPTS, GREEDY, lora_request=[good, None], use_tqdm=False)
    with pytest.raises(TypeError, match=r"prompts\[1\] lora_request must be a LoRARequest or None, got str"):
        lora_llm.generate(PROMPTS, GREEDY, lora_request=[good, "good", None], use_tqdm=False)
    with pytest.raises(TypeError, match="not a list"):
        lora_llm.generate_stream(PROMPTS, GREEDY, lora_request=[good])
    with pytest.raises(ValueError, match="lora_int_id must be >= 1"):
        LoRARequest("zero", 0, folders["good"])
    with pytest.raises(TypeError, match="lora_int_id must be an int"):
        LoRARequest("s", "1", folders["good"])


def test_adapter_config_refusals(tmp_path, folders, lora_llm):
    for change, match in ((dict(use_dora=True), "DoRA"), (dict(bias="all"), "LoRA biases"), (dict(rank_pattern={"q_proj": 4}), "rank_pattern"),
                          (dict(peft_type="IA3"), "only LORA")):
        folder = tmp_path / next(iter(change))
        shutil.copytree(folders["good"], folder)
        config = json.loads((folder / "adapter_config.json").read_text())
        config.update(change)
        (folder / "adapter_config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=match):
            lora_llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest(folder.name, 40 + len(match), str(folder)), use_tqdm=False)


def test_llm_arguments(stories_path):
    with pytest.raises(ValueError, match="max_cpu_loras must be >= max_loras"):
        LLM(stories_path, enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="max_lora_rank must be >= 1"):
        LLM(stories_path, enable_lora=True, max_lora_rank=0)
    with pytest.raises(TypeError, match="enable_lora must be a bool"):
        LLM(stories_path, enable_lora="yes")
    with pytest.raises(ValueError, match="enable_lora=True needs pipeline_parallel_size=1, got 2"):
        LLM(stories_path, enable_lora=True, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="enable_lora=True: LoRA adapters run on generation models only"):
        LLM(stories_path, enable_lora=True, convert="embed")
