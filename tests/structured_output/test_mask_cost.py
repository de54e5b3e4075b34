"""The costs of mask filling cut for a fast model (issue 51): the token ids of forced bytes, which
llguidance asks for through the GIL at every mask of a forced state, memoized; small masks filled
row by row, large ones on llguidance's thread pool; the outputs the same either way."""
import pytest

pytest.importorskip("llguidance")

from json_schemas import SCHEMAS

from pagedgen import SamplingParams, StructuredOutputsParams
from pagedgen.structured_output import manager as manager_mod
from pagedgen.structured_output import vocabulary as vocabulary_mod

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_forced_bytes_tokenization_is_memoized_and_bounded(llm, monkeypatch):
    vocab = llm.processor.grammars._vocabulary(frozenset(llm.eos_token_ids))
    want = vocab._tokenize(b'"name":"')
    first, second = vocab('"name":"'), vocab(b'"name":"')
    assert first == second == want and first is not second  # a fresh list each time: llguidance may keep it
    monkeypatch.setattr(vocabulary_mod, "MEMO_SIZE", 2)
    vocab._memo.clear()  # the session's LLM: earlier tests' strings may already be there (no insert, no bound)
    for text in (b"a", b"b", b"c", b'"name":"'):
        assert vocab(text) == vocab._tokenize(text)
    assert len(vocab._memo) <= 2
    with pytest.raises(ValueError, match="no token of the vocabulary holds the byte"):
        vocab(b"\xff")
    assert b"\xff" not in vocab._memo


def test_masks_row_by_row_and_on_the_thread_pool_give_the_same_outputs(llm, monkeypatch):
    specs = [StructuredOutputsParams(json=s) for s in SCHEMAS[:5]]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=60, structured_outputs=specs[i % 5]) for i in range(20)]
    prompts = ["Once upon a time"] * len(params)
    assert 20 * llm.model_config.vocab_size < manager_mod.PARALLEL_WORK  # stories260K: row by row
    calls = []
    monkeypatch.setattr(llm.processor.grammars, "executor", lambda: calls.append(1) or llm.processor.grammars.__class__.executor(llm.processor.grammars))
    serial = llm.generate(prompts, params, use_tqdm=False)
    assert not calls
    monkeypatch.setattr(manager_mod, "PARALLEL_WORK", 1)
    pooled = llm.generate(prompts, params, use_tqdm=False)
    assert calls
    assert [o.outputs[0].token_ids for o in serial] == [o.outputs[0].token_ids for o in pooled]
