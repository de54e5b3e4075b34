"""int4 W4A16 weights at tensor_parallel_size=2 (issue 46): each rank reads its shard of the 4-bit codes
and of their scales and zero points, unpacked from the checkpoint: a column-parallel layer its rows
(each part's of a fused q/k/v or gate/up layer), a row-parallel one its input features in whole
groups (a per-channel scale whole). Both ranks hold TP = 1's values, so only the all-reduce's float
sum differs: every greedy token agrees, prompt logprobs within 1e-3. A split that would cut a group
is refused naming the layer."""
import pytest

import int4_checkpoints as ic
import tiny_checkpoints
from conftest import story_openings
from pagedgen import LLM, SamplingParams
from worker_rpc import int4_shapes

GREEDY = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=0)
KW = dict(dtype="float32", num_kv_blocks=64, max_num_seqs=16)


def _compare(path, prompts):
    one = LLM(path, **KW)
    want = one.generate(prompts, GREEDY, use_tqdm=False)
    with LLM(path, tensor_parallel_size=2, **KW) as two:
        shapes = two.llm_engine.executor.collective_rpc(int4_shapes)
        got = two.generate(prompts, GREEDY, use_tqdm=False)
    diffs = [abs(lx.logprob - y[t].logprob) for a, b in zip(want, got) for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])
             for t, lx in x.items()]
    assert all(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(want, got))
    assert max(diffs) < 1e-3, max(diffs)
    return shapes


def test_tp2_per_channel_pack_quantized(stories_path, hf_model, tmp_path):
    ic.write_int4(hf_model, stories_path, str(tmp_path), "pack-quantized", -1, False)
    shapes = _compare(str(tmp_path), story_openings(16, seed=11))
    for rank in shapes:  # stories260K: q 64 + k 32 + v 32 outputs -> 64 a rank; down_proj's 172 inputs -> 86, one scale a row
        assert rank["model.layers.0.self_attn.qkv_proj"] == ((4, 64, 8), (4, 1, 16), 64)
        assert rank["model.layers.0.mlp.down_proj"] == ((4, 86, 8), (4, 1, 16), 86)


def test_tp2_groups_of_a_tiny_llama(tmp_path):
    src, dst = str(tmp_path / "float"), str(tmp_path / "gptq")
    model = tiny_checkpoints.build("llama", src)  # hidden 64, intermediate 128: 32 and 64 inputs a rank
    ic.write_int4(model, src, dst, "gptq", 32, False, "gptq_v2")
    shapes = _compare(dst, [[int(t) for t in range(n, 3 * n)] for n in (3, 7, 12, 20)])
    for rank in shapes:
        assert rank["model.layers.0.mlp.down_proj"] == ((4, 64, 8), (4, 2, 16), 32)
        assert rank["model.layers.0.self_attn.o_proj"] == ((4, 32, 8), (4, 1, 16), 32)


def test_a_split_that_cuts_a_group_is_refused(stories_path, hf_model, tmp_path):
    ic.write_int4(hf_model, stories_path, str(tmp_path), "awq", 32, False)
    with pytest.raises(ValueError, match=r"LLM tensor_parallel_size=2: model.layers.0.mlp.down_proj: group_size=32 does not divide this rank's 86 input features: "
                                         r"tensor_parallel_size=2 cuts a group"):
        LLM(str(tmp_path), tensor_parallel_size=2, **KW)
