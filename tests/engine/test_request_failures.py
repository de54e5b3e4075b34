"""A request that fails alone mid-generation (its structured-output grammar over llguidance's parser
row limit) fails alone: ``on_error="return"`` finishes it "error" with the reason while the others
complete, ``"raise"`` raises naming it, None keeps vLLM's behaviour ("stop" and a warning); the LLM
then equals a fresh one (a tiny random Llama with the GPT-2 tokenizer's first 4,096 ids)."""
import re

import pytest

from conftest import tiny_prompts
from pagedgen import LLM, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# a second ``x`` opens a parser row of 2,501 items (llguidance's max_items_in_row is 2,000)
ROW_LIMIT = StructuredOutputsParams(grammar="start: x x\nx: " + " | ".join(f'"w{i}" y' for i in range(2500)) + '\ny: "a" | "b"')
FAILING = SamplingParams(temperature=1.0, seed=1, max_tokens=40, structured_outputs=ROW_LIMIT)
PLAIN = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)
REASON = r"llguidance failed on its grammar constraint \(.*max is 2000.*\) after \d+ generated tokens"


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def fresh(tiny_gpt2):
    """What a fresh LLM gives for the plain requests alone."""
    return _tokens(LLM(tiny_gpt2, max_num_seqs=64).generate(tiny_prompts(256), PLAIN, use_tqdm=False))


def test_three_failures_in_256_requests_fail_alone(tiny_gpt2, fresh):
    llm = LLM(tiny_gpt2, max_num_seqs=64)
    failing = {17, 100, 255}
    params = [FAILING if i in failing else PLAIN for i in range(256)]
    outs = llm.generate(tiny_prompts(256), params, use_tqdm=False, on_error="return")
    errors = [o for o in outs if o.error is not None]
    assert sorted(o.index for o in errors) == sorted(failing) and len(outs) - len(errors) == 253
    for o in errors:
        assert re.fullmatch(REASON, o.error) and o.outputs[0].finish_reason == "error" and o.outputs[0].stop_reason is None
        assert o.outputs[0].token_ids and "error=" in repr(o)
    # the others complete, each as it would alone (seeded draws), and the LLM then equals a fresh one
    assert [t for i, t in enumerate(_tokens(outs)) if i not in failing] == [t for i, t in enumerate(fresh) if i not in failing]
    assert _tokens(llm.generate(tiny_prompts(256), PLAIN, use_tqdm=False)) == fresh
    assert llm.llm_engine.block_manager.num_used_blocks == 0


def test_raise_names_the_request_and_leaves_the_llm_as_fresh(tiny_gpt2, fresh):
    llm = LLM(tiny_gpt2, max_num_seqs=64)
    params = [FAILING if i == 5 else PLAIN for i in range(32)]
    with pytest.raises(RuntimeError, match=r"prompts\[5\] failed mid-generation: " + REASON):
        llm.generate(tiny_prompts(32), params, use_tqdm=False, on_error="raise")
    assert not llm.llm_engine.has_unfinished_requests() and llm.llm_engine.block_manager.num_used_blocks == 0
    assert _tokens(llm.generate(tiny_prompts(256), PLAIN, use_tqdm=False)) == fresh
    # in a stream: the outputs finished before it are yielded, then it raises
    seen = []
    with pytest.raises(RuntimeError, match=r"prompts\[5\] failed"):
        for out in llm.generate_stream(list(zip(tiny_prompts(32), params)), max_in_flight=8, on_error="raise"):
            seen.append(out.index)
    assert 5 not in seen  # the plain requests need 6 steps, request 5 fails in its second
    assert _tokens(llm.generate(tiny_prompts(256), PLAIN, use_tqdm=False)) == fresh


def test_default_is_vllms_behaviour_and_the_engine_api_returns_it(tiny_gpt2, caplog):
    llm = LLM(tiny_gpt2, max_num_seqs=8)
    with caplog.at_level("WARNING", logger="pagedgen"):
        (out,) = llm.generate(tiny_prompts(1), FAILING, use_tqdm=False)
    assert out.error is None and out.outputs[0].finish_reason == "stop" and "llguidance failed" in caplog.text
    stream = list(llm.generate_stream([(p, FAILING) for p in tiny_prompts(2)], on_error="return"))
    assert [o.outputs[0].finish_reason for o in stream] == ["error", "error"] and all(o.error for o in stream)
    engine = llm.llm_engine
    engine.add_request("a", tiny_prompts(1)[0], FAILING, on_error="return")
    engine.add_request("b", tiny_prompts(2)[1], PLAIN)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step()})
    assert re.fullmatch(REASON, done["a"].error) and done["b"].error is None and done["b"].outputs[0].finish_reason == "length"
    n2 = llm.generate(tiny_prompts(1), FAILING.clone(n=2), use_tqdm=False, on_error="return")[0]
    assert [c.finish_reason for c in n2.outputs] == ["error", "error"] and n2.error.startswith("completion 0: llguidance failed")


def test_bad_on_error_values_are_refused_before_any_work(tiny_gpt2):
    llm = LLM(tiny_gpt2, max_num_seqs=8)
    for call in (lambda: llm.generate(tiny_prompts(1), PLAIN, on_error="skip"), lambda: llm.chat([{"role": "user", "content": "hi"}], on_error=1),
                 lambda: llm.generate_stream(tiny_prompts(1), on_error="ignore")):
        with pytest.raises(ValueError, match="on_error must be None \\(vLLM's behaviour\\), 'return' or 'raise'"):
            call()
    with pytest.raises(ValueError, match="request 'x' on_error must be None \\(vLLM's behaviour\\) or 'return'"):
        llm.llm_engine.add_request("x", tiny_prompts(1)[0], PLAIN, on_error="raise")
    assert not llm.llm_engine.has_unfinished_requests()
