"""JSON a small model cannot run away with (issue 51): whitespace between JSON tokens bounded by
default, numbers bounded to what an int64 / float64 holds by the number guard (unless the schema
asks for longer ones), the guard's mask computed only inside numbers without changing any output,
and stories260K sampling at temperature 1 finishing valid JSON where it used to run to max_tokens."""
import json

import pytest
import torch

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from pagedgen import SamplingParams, StructuredOutputsParams
from pagedgen.structured_output import json_bounds

pytestmark = pytest.mark.usefixtures("one_torch_thread")

S = StructuredOutputsParams


def _fits(llm, spec: StructuredOutputsParams, text: str) -> bool:
    """True when ``text`` is a viable prefix (or all) of the constraint, matcher and guard alike."""
    compiler = llm.processor.grammars
    grammar = compiler.grammar(spec, llm.eos_token_ids)
    ids = compiler._vocabulary(frozenset(llm.eos_token_ids))(text)
    return grammar.validate(ids) == len(ids)


def _complete(llm, spec: StructuredOutputsParams, text: str) -> bool:
    """True when ``text`` is a whole sentence of the constraint (it may end there: EOS allowed)."""
    compiler = llm.processor.grammars
    grammar = compiler.grammar(spec, llm.eos_token_ids)
    ids = compiler._vocabulary(frozenset(llm.eos_token_ids))(text)
    return grammar.accept(ids) and grammar.is_accepting()


def test_whitespace_is_bounded_but_pretty_printing_stays_possible(llm):
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "array", "items": {"type": "integer"}}}}}}
    value = {"a": {"b": [1, 2]}}
    spec = S(json=schema)
    for text in (json.dumps(value), json.dumps(value, indent=2), json.dumps(value, indent="\t"), json.dumps(value, separators=(",", ":"))):
        assert _complete(llm, spec, text), text
    assert not _fits(llm, spec, '{\n\n"a"')  # two newlines
    assert not _fits(llm, spec, '{"a"  :')  # two spaces
    assert not _fits(llm, spec, "{\n" + " " * (json_bounds.MAX_INDENT + 1) + '"a"')  # indentation past MAX_INDENT
    assert _fits(llm, spec, "{\n" + " " * json_bounds.MAX_INDENT + '"a"')
    compact = S(json=schema, disable_any_whitespace=True)
    assert _complete(llm, compact, json.dumps(value, separators=(",", ":"))) and not _fits(llm, compact, "{ ")
    # the schema's own x-guidance options win: free whitespace again
    free = S(json=dict(schema, **{"x-guidance": {"whitespace_flexible": True}}))
    assert _fits(llm, free, '{\n\n\n      \n"a"')


@pytest.mark.parametrize("kind", ["number", "json_object"])
def test_numbers_hold_what_a_float64_or_int64_holds(llm, kind):
    spec = S(json={"type": "array", "items": {"type": "number"}}) if kind == "number" else S(json_object=True)
    wrap = (lambda n: f"[{n}]") if kind == "number" else (lambda n: '{"x": %s}' % n)
    for good in ("0", "-0.5", "0.12345678901234567", "1234567890123456.7", "9223372036854775807", "1234567890123456789",
                 "1.5e-300", "-2E+12", "12345678901234567e100"):
        assert _complete(llm, spec, wrap(good)), good
    for bad in ("0.123456789012345678", "1234567890123456.78", "12345678901234567890", "1e1000", "0.1000000000000000000"):
        assert not _fits(llm, spec, wrap(bad)), bad
    assert _fits(llm, spec, wrap("0.1000000000000000")[:-1])  # a long fraction up to its limit...
    assert _complete(llm, spec, wrap("0.1000000000000000"))  # ...which then must end
    # strings and keys are not numbers: digits run on there as the schema allows
    assert _complete(llm, S(json_object=True), '{"123456789012345678901234567890": "0.1000000000000000000000000"}')


def test_a_schema_that_asks_for_long_numbers_gets_them(llm):
    for schema, text in (({"type": "integer", "minimum": 10**17}, "123456789012345678901"),
                         ({"type": "number", "maximum": 1e18}, "12345678901234567.5")):
        assert json_bounds.wants_big_numbers(schema)
        assert _complete(llm, S(json=schema), text), schema
    assert json_bounds.wants_big_numbers({"enum": [0.5, {"a": [2e-16]}]}) and json_bounds.wants_big_numbers({"const": 10**17})
    assert not json_bounds.wants_big_numbers({"type": "number", "minimum": -1e16, "maximum": 0.001, "multipleOf": 1e-10, "x": [True, 0]})


def test_guard_at_its_digit_limit_against_an_exclusive_bound_is_a_dead_end(llm):
    """A number the schema can only complete past the guard's 17 digits: no token is allowed
    (the manager's dead-end check then ends the request with EOS and a warning)."""
    compiler = llm.processor.grammars
    grammar = compiler.grammar(S(json={"type": "number", "exclusiveMinimum": 0.5, "exclusiveMaximum": 0.6}), llm.eos_token_ids)
    assert grammar.accept(compiler._vocabulary(frozenset(llm.eos_token_ids))("0.50000000000000000"))
    row = torch.zeros(1, compiler.num_words, dtype=torch.int32)
    grammar.fill_bitmask(row, 0)
    assert not row.any() and not grammar.is_accepting()


PET = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer"}, "happy": {"type": "boolean"}},
       "required": ["kind", "legs", "happy"], "additionalProperties": False}
POINTS = {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 3}


def _run(llm, n=8):
    prompts, params = [], []
    for schema in (PET, POINTS):
        for seed in range(n):
            prompts.append("Once upon a time")
            params.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=120, structured_outputs=S(json=schema)))
    return llm.generate(prompts, params, use_tqdm=False)


def test_stories260k_at_temperature_one_finishes_valid_json(llm, monkeypatch):
    """Free whitespace and unbounded numbers let stories260K run to max_tokens in every one of
    these (runs of newlines, 0.1000000...); bounded, every completion ends on EOS, valid. The
    guard's mask computed at every step gives the same tokens as computed only inside numbers."""
    outs = _run(llm)
    for i, out in enumerate(outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (i, c.text)
        jsonschema.validate(json.loads(c.text), (PET, POINTS)[i // 8])
    assert any("." in o.outputs[0].text for o in outs[8:])  # decimals were written (the guard had work)
    vocab = llm.processor.grammars._vocabulary(frozenset(llm.eos_token_ids))
    assert not vocab.guard_every_step  # stories260K: no token of 18 digits
    monkeypatch.setattr(vocab, "guard_every_step", True)
    assert [o.outputs[0].token_ids for o in _run(llm)] == [o.outputs[0].token_ids for o in outs]


def test_which_vocabularies_need_the_guard_mask_at_every_step():
    """Only a token that could break a bound on its own (17 digits in one run of digits and points,
    or a 4-digit exponent) makes the guard's mask an every-step cost; GPT-2's runs of dots do not."""
    assert not json_bounds.guard_unsafe_tokens([b"." * 64, b"1999", b"3.14159", b"e+12", b"\xff<[5]>"])
    assert json_bounds.guard_unsafe_tokens([b"x", b"12345678.123456789"])  # 17 digits
    assert json_bounds.guard_unsafe_tokens([b"1e1000"])
    assert json_bounds.needs_guard_mask(b":1", False) and json_bounds.needs_guard_mask(b"e", False)
    assert not json_bounds.needs_guard_mask(b'",', False) and not json_bounds.needs_guard_mask(None, False)
    assert json_bounds.needs_guard_mask(None, True)
