"""Closing JSON before the token limit (issue 51, ``StructuredOutputsParams.close_at_max_tokens``):
a JSON request near ``max_tokens`` is steered to the shortest closing its grammar allows, so that
stories260K at temperature 1 ends open schemas (free strings, keys of its own) as valid JSON; the
outputs of requests that end well before the limit, and of those whose limit is below any closing,
are those without it; the same with and without jump-forward decoding."""
import json

import numpy as np
import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from pagedgen import SamplingParams, StructuredOutputsParams
from pagedgen.structured_output import closing

pytestmark = pytest.mark.usefixtures("one_torch_thread")

OPEN = {"type": "object", "properties": {"place": {"type": "string"}, "wind": {"type": "object", "properties": {"speed": {"type": "number"}},
                                                                            "required": ["speed"]}},
        "required": ["place", "wind"]}  # free strings, and objects that admit keys of the model's own
CLOSED = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
          "required": ["kind", "legs"], "additionalProperties": False}
PROMPTS = ["Once upon a time", "The little dog", "Lily wanted to", "One day, Tom"]


def _run(llm, schema, close: bool, max_tokens: int, n: int = 16, **spec):
    params = [SamplingParams(temperature=1.0, seed=300 + i, max_tokens=max_tokens,
                             structured_outputs=StructuredOutputsParams(json=schema, close_at_max_tokens=close, **spec)) for i in range(n)]
    return [o.outputs[0] for o in llm.generate([PROMPTS[i % 4] for i in range(n)], params, use_tqdm=False)]


def _valid(schema, text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


@pytest.mark.parametrize("compact", [False, True])
def test_open_schemas_close_by_max_tokens(llm, compact):
    before = _run(llm, OPEN, False, 80, disable_any_whitespace=compact)
    after = _run(llm, OPEN, True, 80, disable_any_whitespace=compact)
    assert sum(c.finish_reason == "length" for c in before) >= 4  # the model runs on inside free strings
    assert all(c.finish_reason == "stop" and _valid(OPEN, c.text) for c in after), [c.text for c in after if not _valid(OPEN, c.text)]
    assert all(_valid(OPEN, c.text) for c in before if c.finish_reason == "stop")
    assert llm.llm_engine.grammars.num_closing_masks > 0
    for b, a in zip(before, after):  # the steering starts near the limit only: what came before it is the same
        assert a.token_ids[:20] == b.token_ids[:20]


def test_requests_that_end_early_or_cannot_close_are_not_touched(llm):
    assert [c.token_ids for c in _run(llm, CLOSED, True, 120)] == [c.token_ids for c in _run(llm, CLOSED, False, 120)]
    # 6 tokens hold no closing of OPEN from its start: left to the model (the steering would only empty strings)
    masks = llm.llm_engine.grammars.num_closing_masks
    assert [c.token_ids for c in _run(llm, OPEN, True, 6)] == [c.token_ids for c in _run(llm, OPEN, False, 6)]
    assert llm.llm_engine.grammars.num_closing_masks == masks


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_closing_gives_the_same_outputs_with_and_without_jump_forward(llm, temperature):
    params = [SamplingParams(temperature=temperature, seed=40 + i, max_tokens=60, structured_outputs=StructuredOutputsParams(json=OPEN))
              for i in range(8)]
    grammars = llm.llm_engine.grammars
    closed = grammars.num_closing_masks
    try:
        grammars.jump_forward = False
        plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS * 2, params, use_tqdm=False)]
        grammars.jump_forward = True
        jumped = [o.outputs[0].token_ids for o in llm.generate(PROMPTS * 2, params, use_tqdm=False)]
    finally:
        grammars.jump_forward = True
    assert jumped == plain
    assert grammars.num_closing_masks > closed  # the steering did take part


def test_text_state_and_steer():
    assert closing.text_state(b'{"a": "x') == (True, False)
    assert closing.text_state(b'{"a": "x\\') == (True, True)
    assert closing.text_state(b'{"a": "x\\"') == (True, False)  # an escaped quote
    assert closing.text_state(b'{"a": "x\\\\"') == (False, False)  # an escaped backslash, then the closing quote
    assert closing.text_state(b'{"a": 1') == (False, False)
    tokens = [b"\xff<eos>", b"}", b'"', b",", b"a", b"7", b'"}', b" "]
    tables = closing.ClosingTables(tokens, [0], 1)

    def mask(*ids):
        return np.array([sum(1 << i for i in ids)], dtype=np.uint32)

    rows = np.stack([mask(1, 2, 4, 6, 7), mask(1, 2, 4, 6, 7), mask(3, 4, 7), mask(4, 7), mask(0, 1)])  # [5, 1]
    closing.steer(rows, np.array([True, False, False, True, False]), tables)
    assert rows.tolist() == [mask(6).tolist(), mask(1).tolist(), mask(3).tolist(), mask(4, 7).tolist(), mask(0).tolist()]
    # inside a string '"}' (close it and the object) first; outside '}'; then ','; none of the classes: the mask as it was; EOS first


def test_the_option_is_checked_and_shown():
    with pytest.raises(TypeError, match="close_at_max_tokens must be a bool"):
        StructuredOutputsParams(json_object=True, close_at_max_tokens="no")
    assert "close_at_max_tokens=False" in repr(StructuredOutputsParams(json_object=True, close_at_max_tokens=False))
    assert "close_at_max_tokens" not in repr(StructuredOutputsParams(json_object=True))
