"""int4 W4A16 checkpoints (issue 46) of every family of the registry: tiny random-weight models
(tests/support/tiny_checkpoints.py) written as GPTQ, AWQ or compressed-tensors pack-quantized
(group 32) by tests/support/int4_checkpoints.py, their greedy tokens each the argmax of
transformers' model holding the real (fake-quantized) weights. GPT-2's Conv1D layers are packed
by GPTQ (as AutoGPTQ does; llm-compressor leaves them float), GPT-NeoX's interleaved q/k/v rows are
reordered after unpacking."""
import pytest
import torch

import int4_checkpoints as ic
import tiny_checkpoints
from pagedgen import LLM, SamplingParams


def _oracle_logprobs(oracle, outs) -> list:
    """Teacher-forced log-probabilities [completion tokens, vocab] of each output (right-padded, causal)."""
    seqs = [o.prompt_token_ids + list(o.outputs[0].token_ids) for o in outs]
    ids = torch.tensor([s + [0] * (max(map(len, seqs)) - len(s)) for s in seqs])
    with torch.no_grad():
        logp = torch.log_softmax(oracle(ids).logits.double(), -1)
    return [logp[i, len(o.prompt_token_ids) - 1:len(seqs[i]) - 1] for i, o in enumerate(outs)]


FORMATS = ("gptq", "awq", "pack-quantized")


@pytest.mark.parametrize("family", sorted(tiny_checkpoints.FAMILIES))
def test_every_family_runs_an_int4_checkpoint(family, tmp_path):
    src, dst = str(tmp_path / "float"), str(tmp_path / "int4")
    model = tiny_checkpoints.build(family, src)
    fmt = FORMATS[sorted(tiny_checkpoints.FAMILIES).index(family) % 3]
    if family == "gpt2":
        fmt = "gptq"  # its Conv1D layers: AutoGPTQ packs them, llm-compressor leaves them float
    real = ic.write_int4(model, src, dst, fmt, 32, fmt != "awq")
    prompts = [[int(t) for t in torch.randint(1, 4096, (n,), generator=torch.Generator().manual_seed(n))] for n in (5, 11, 20)]
    llm = LLM(dst, dtype="float32", num_kv_blocks=32, max_num_seqs=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    assert sum(bool(getattr(m, "int4_group", 0)) for m in llm.model.modules()) >= 4
    for o, logp in zip(outs, _oracle_logprobs(ic.fake_quantize(model, real), outs)):
        assert logp.argmax(-1).tolist() == list(o.outputs[0].token_ids)
