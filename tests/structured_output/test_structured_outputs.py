"""Structured outputs (issue 33): JSON schemas, regexes, choices and grammars, valid by construction,
on stories260K (SentencePiece-style vocabulary of 512) and a tiny random model with the GPT-2
tokenizer cut to 4,096 ids (whose EOS is the text token "!"); with sampling and seeds, preemption
(recompute and swap), prefix caching, chunked prefill, n > 1, stop strings, aborts and interrupted
steps; bad constraints refused before any work; the bitmask op against its reference."""
import json
import re
import threading

import pytest
import torch

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")  # a core dependency; absent only from a foreign image (the GPU machine's)

from conftest import story_openings, tiny_prompts
from json_schemas import SCHEMAS

from pagedgen import LLM, BeamSearchParams, SamplingParams, StructuredOutputsParams
from pagedgen.structured_output import manager as manager_mod
from pagedgen.structured_output.token_bitmask import GrammarBitmask, apply_token_bitmask, apply_token_bitmask_reference


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # shared CPU: one intra-op thread is many times faster

SPECS = [StructuredOutputsParams(json=s, disable_any_whitespace=True) for s in SCHEMAS]


def _assert_valid_json(outs, schemas):
    for i, out in enumerate(outs):
        for c in out.outputs:
            assert c.finish_reason == "stop", (i, c.finish_reason, c.text)
            jsonschema.validate(json.loads(c.text), schemas[i % len(schemas)])


def _ids(outs):
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


# ----- the op and the parameters -----------------------------------------------------------------
@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100, 512, 5000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("density", ["dense", "sparse"])  # the two CPU paths (SPARSE_WORDS)
def test_token_bitmask_matches_reference(vocab, dtype, density):
    g = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32 + (vocab % 3)  # sometimes wider than needed: the extra bits are ignored
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, words), dtype=torch.int32, generator=g)
    if density == "sparse":  # one word per row allows tokens (the last row's word the last, past the vocab in part)
        keep = torch.zeros_like(bitmask)
        for row in range(5):
            col = words - 1 if row == 4 else (row * 7) % words
            keep[row, col] = bitmask[row, col] | 1
        bitmask = keep
    logits = torch.randn(5, vocab, generator=g).to(dtype)
    expected = apply_token_bitmask_reference(logits, bitmask)
    assert expected.dtype == dtype and torch.isinf(expected).any() and torch.isfinite(expected).any()
    got = logits.clone()
    apply_token_bitmask(got, bitmask)
    assert torch.equal(got, expected)
    # only the constrained rows, in the sampler's order (rows 3 and 1 of 5, their masks given as 1, 3)
    seqs = [type("S", (), {"seq_id": 10 + i})() for i in range(5)]
    got = logits.clone()
    GrammarBitmask([13, 11], bitmask[[3, 1]]).apply(got, seqs)
    want = logits.clone()
    want[[1, 3]] = expected[[1, 3]]
    assert torch.equal(got, want)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_token_bitmask_on_the_gpu_matches_reference():
    g = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (7, 1536), dtype=torch.int32, generator=g)  # 49,152 tokens
    logits = torch.randn(7, 49152, generator=g).to(torch.bfloat16)
    got = logits.cuda()
    apply_token_bitmask(got, bitmask)
    assert torch.equal(got.cpu(), apply_token_bitmask_reference(logits, bitmask))


def test_params_checks():
    S = StructuredOutputsParams
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar, json_object, got none"):
        S()
    with pytest.raises(ValueError, match="got json, regex"):
        S(json={"type": "string"}, regex="a")
    with pytest.raises(ValueError, match="choice must hold at least one"):
        S(choice=[])
    with pytest.raises(TypeError, match="choice must be a list of str"):
        S(choice=["a", 1])
    with pytest.raises(ValueError, match="json is not valid JSON"):
        S(json="{nope")
    with pytest.raises(TypeError, match="json must be a dict"):
        S(json=3)
    with pytest.raises(TypeError, match="json must be JSON: Object of type set is not JSON serializable"):
        S(json={"enum": {1, 2}})
    with pytest.raises(ValueError, match="json must be JSON: Out of range float values"):
        S(json={"type": "number", "maximum": float("nan")})
    pydantic = pytest.importorskip("pydantic")

    class Point(pydantic.BaseModel):
        x: int
        y: int

    assert S(json=Point).json["required"] == ["x", "y"]
    assert S(json='{"type": "integer"}').key == S(json={"type": "integer"}).key != S(json={"type": "integer"}, disable_any_whitespace=True).key
    for bad in (dict(ignore_eos=True), dict(min_tokens=2), dict(allowed_token_ids=[1, 2])):
        with pytest.raises(ValueError, match=f"{next(iter(bad))} cannot be combined with structured_outputs"):
            SamplingParams(structured_outputs=S(choice=["a"]), **bad)
    with pytest.raises(TypeError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"choice": ["a"]})
    with pytest.raises(ValueError, match="beam search with a structured-output constraint is not supported"):
        BeamSearchParams(beam_width=2, max_tokens=4, structured_outputs=S(choice=["a"]))
    assert "structured_outputs=StructuredOutputsParams(choice=['a'])" in repr(SamplingParams(structured_outputs=S(choice=["a"])))


def test_constraint_changed_after_it_was_built_is_the_one_applied(llm):
    """Fields changed after construction are checked again and honoured, as SamplingParams' are
    (each request gets a private, validated copy): not the stale compiled key."""
    spec = StructuredOutputsParams(regex="a+")
    params = SamplingParams(max_tokens=4, structured_outputs=spec)
    params.structured_outputs.regex = "b+"
    assert params.structured_outputs.key == ("regex", "b+", False)
    text = llm.generate(["Hi"], params, use_tqdm=False)[0].outputs[0].text
    assert re.fullmatch("b+", text), text
    params.structured_outputs.choice = ["x"]  # now two kinds: refused when the request is added, naming it
    with pytest.raises(ValueError, match=r"sampling_params\[1\]: StructuredOutputsParams needs exactly one of .* got regex, choice"):
        llm.generate(["Hi", "Ho"], [SamplingParams(max_tokens=2), params], use_tqdm=False)
    params.structured_outputs.regex = None
    assert llm.generate(["Hi"], params, use_tqdm=False)[0].outputs[0].text == "x"


def test_bad_constraints_are_refused_before_any_work(llm):
    S = StructuredOutputsParams
    before = llm.get_stats().num_generated_tokens
    good = SamplingParams(structured_outputs=S(choice=["yes", "no"]))
    cases = [
        (S(json={"type": "foo"}), "invalid json: .*foo"),
        (S(json={"type": "integer", "minimum": 5, "maximum": 3}), "invalid json: Unsatisfiable schema: minimum .*greater than maximum"),
        (S(regex="[a-"), "invalid regex: .*unclosed character class"),
        (S(regex="[^\\x00-\\U0010FFFF]"), "no token sequence of this vocabulary satisfies the regex"),
        (S(grammar="start: ( "), "invalid grammar"),
    ]
    for spec, message in cases:
        with pytest.raises(ValueError, match=r"(?s)sampling_params\[2\]\.structured_outputs: " + message):
            llm.generate(["a", "b", "c"], [good, good, SamplingParams(structured_outputs=spec)], use_tqdm=False)
        with pytest.raises(ValueError, match=r"(?s)request 'x' sampling_params\.structured_outputs: " + message):
            llm.llm_engine.add_request("x", "a", SamplingParams(structured_outputs=spec))
    assert llm.get_stats().num_generated_tokens == before and not llm.llm_engine.has_unfinished_requests()


# ----- JSON schemas: every output parses and validates -------------------------------------------
def test_json_schemas_stories_sampled_with_preemption_and_prefix_caching(stories_path):
    """500 requests over the ten schemas, temperature 1 with seeds, on a KV cache small enough to
    preempt, with prefix caching (the prompts share openings)."""
    llm = LLM(stories_path, num_kv_blocks=160, max_num_seqs=64, enable_prefix_caching=True)
    prompts = story_openings(100) * 5
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=160, structured_outputs=SPECS[i % 10]) for i in range(500)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    _assert_valid_json(outs, SCHEMAS)
    stats = llm.get_stats()
    assert stats.num_preemptions > 0 and stats.num_cached_tokens > 0
    assert llm.processor.grammars.num_compiled == 10  # once per distinct schema


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_json_schemas_gpt2_tokenizer(tiny_gpt2, batch_invariant):
    """The GPT-2 tokenizer cut to the model's 4,096 ids, EOS a text token: still valid JSON, with and
    without batch invariance; the same seeds give the same outputs in a batch and alone."""
    llm = LLM(tiny_gpt2, max_num_seqs=64, batch_invariant=batch_invariant)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=200, structured_outputs=SPECS[i % 10]) for i in range(100)]
    outs = llm.generate(tiny_prompts(100), params, use_tqdm=False)
    _assert_valid_json(outs, SCHEMAS)
    assert all(0 not in c.token_ids[:-1] for o in outs for c in o.outputs)  # "!" (EOS) only at the end
    if batch_invariant:
        alone = llm.generate(tiny_prompts(100)[7:8], params[7], use_tqdm=False)
        assert _ids(alone) == _ids(outs[7:8])


def test_pydantic_model(llm):
    pydantic = pytest.importorskip("pydantic")

    class Pet(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")  # additionalProperties: false
        name: str = pydantic.Field(max_length=8)
        legs: int = pydantic.Field(ge=0, le=8)

    spec = StructuredOutputsParams(json=Pet, disable_any_whitespace=True)
    outs = llm.generate(story_openings(3), [SamplingParams(temperature=0.8, seed=i, max_tokens=120, structured_outputs=spec) for i in range(3)],
                        use_tqdm=False)
    for o in outs:
        Pet.model_validate_json(o.outputs[0].text)


def _accepts(llm, spec, text):
    """Whether the grammar of ``spec`` takes ``text`` (as the tokenizer splits it) and may end after it."""
    compiler = llm.processor.grammars
    g = compiler.grammar(spec, llm.eos_token_ids)
    ids = compiler._vocabulary(llm.eos_token_ids)(text)  # as llguidance splits text (no SentencePiece space first)
    if g.validate(ids) < len(ids):
        return False
    g.accept(ids)
    bitmask = torch.zeros(1, llm.processor.grammars.num_words, dtype=torch.int32)
    g.fill_bitmask(bitmask, 0)
    eos = next(iter(llm.eos_token_ids))
    return bool((bitmask[0, eos // 32] >> (eos % 32)) & 1)


def test_json_object_and_whitespace(llm):
    """json_object takes any JSON object and nothing else; JSON takes whitespace between tokens
    unless disable_any_whitespace (the small models here, left free, write whitespace runs)."""
    S = StructuredOutputsParams
    assert _accepts(llm, S(json_object=True), '{"a": [1, 2.5, {"b": null}], "c": "d"}')
    assert not _accepts(llm, S(json_object=True), "[1, 2]") and not _accepts(llm, S(json_object=True), '{"a": 1')
    schema = SCHEMAS[0]
    assert _accepts(llm, S(json=schema), '{ "name": "Tim",\n  "age": 3 }')
    assert _accepts(llm, S(json=schema, disable_any_whitespace=True), '{"name":"Tim","age":3}')
    assert not _accepts(llm, S(json=schema, disable_any_whitespace=True), '{"name": "Tim","age":3}')
    assert not _accepts(llm, S(json=schema), '{"name":"Tim","age":300}')
    # validate does not advance; rollback undoes accepted tokens
    vocab = llm.processor.grammars._vocabulary(llm.eos_token_ids)
    g = llm.processor.grammars.grammar(S(regex="(ab|cd)e"), llm.eos_token_ids)
    ab, cd = vocab("ab"), vocab("cd")
    assert g.validate(ab + vocab("x")) == len(ab) and g.accept(ab)
    g.rollback(len(ab))
    assert g.accept(cd + vocab("e")) and g.is_terminated()  # nothing can follow: the grammar has ended


# ----- regexes, choices and grammars -----------------------------------------------------------------
def test_regex_choice_and_grammars(llm):
    S = StructuredOutputsParams
    regexes = [r"[a-z]{3,8}( [a-z]{2,6}){1,3}\.", r"(yes|no), because [a-z ]{5,20}", r"\d{4}-\d{2}-\d{2}", r"[A-Z][a-z]+ (said|asked) \"[^\"]{1,12}\""]
    choices = ["happy", "sad", "a little bit scared", "🙂 fine"]
    lark = 'start: greeting " " name "!"\ngreeting: "Hello" | "Hi"\nname: /[A-Z][a-z]{1,6}/'
    gbnf = 'root ::= "The " animal " is " color "."\nanimal ::= "cat" | "dog"\ncolor ::= "red" | "blue"'
    prompts = story_openings(40)
    params = ([SamplingParams(temperature=1.0, seed=i, max_tokens=60, structured_outputs=S(regex=regexes[i % 4])) for i in range(16)]
              + [SamplingParams(temperature=1.0, seed=i, max_tokens=20, structured_outputs=S(choice=choices)) for i in range(12)]
              + [SamplingParams(temperature=1.0, seed=i, max_tokens=30, structured_outputs=S(grammar=[lark, gbnf][i % 2])) for i in range(12)])
    outs = llm.generate(prompts, params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs), [(o.outputs[0].finish_reason, o.outputs[0].text) for o in outs]
    for i, t in enumerate(texts[:16]):
        assert re.fullmatch(regexes[i % 4], t), (regexes[i % 4], t)
    assert all(t in choices for t in texts[16:28]) and len(set(texts[16:28])) > 1
    for i, t in enumerate(texts[28:]):
        pattern = r"(Hello|Hi) [A-Z][a-z]{1,6}!" if i % 2 == 0 else r"The (cat|dog) is (red|blue)\."
        assert re.fullmatch(pattern, t), t


def test_long_choice_lists_and_the_empty_choice(llm):
    """5,000 choices (llguidance's own choice grammar puts them in one parser row: past its 2,000
    items a RuntimeError mid-generation), a choice that is a prefix of another, "", quotes and newlines."""
    S = StructuredOutputsParams
    many = [f"c{i}" for i in range(5000)]
    outs = llm.generate(["Hi"] * 6, [SamplingParams(max_tokens=8, seed=i, temperature=1.0, structured_outputs=S(choice=many))
                                     for i in range(6)], use_tqdm=False)
    assert all(o.outputs[0].text in many and o.outputs[0].finish_reason == "stop" for o in outs)
    for choices in (["a", "ab"], ["", "ab"], [""], ['q"uo\\te', "new\nline"]):
        for text in choices:
            assert _accepts(llm, S(choice=choices), text), (choices, text)
        assert not _accepts(llm, S(choice=choices), "abc")


def test_eos_only_where_the_grammar_may_end_and_length_mid_structure(llm):
    S = StructuredOutputsParams
    eos = next(iter(llm.eos_token_ids))
    # EOS pushed up by +100: still taken only once the choice is complete
    outs = llm.generate(story_openings(4), SamplingParams(temperature=0, max_tokens=20, logit_bias={eos: 100.0},
                                                         structured_outputs=S(choice=["once upon a time", "the end"])), use_tqdm=False)
    assert {o.outputs[0].text for o in outs} <= {"once upon a time", "the end"} and all(o.outputs[0].token_ids[-1] == eos for o in outs)
    # max_tokens reached inside the structure: "length", as vLLM, the text a prefix of a valid one
    outs = llm.generate(story_openings(4), SamplingParams(temperature=0, max_tokens=5, structured_outputs=SPECS[1]), use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "length" and len(c.token_ids) == 5 and '{"person":{"first":'.startswith(c.text)


def test_generate_stream(llm):
    """Constrained items of generate_stream follow their constraints; a bad one is reported by index
    after the items before it."""
    S = StructuredOutputsParams
    items = [(p, SamplingParams(temperature=1.0, seed=i, max_tokens=160, structured_outputs=SPECS[i % 10])) for i, p in enumerate(story_openings(12))]
    outs = sorted(llm.generate_stream(iter(items), use_tqdm=False), key=lambda o: o.index)
    _assert_valid_json(outs, SCHEMAS)
    items[5] = (items[5][0], SamplingParams(structured_outputs=S(regex="(")))
    seen = []
    with pytest.raises(ValueError, match=r"prompts\[5\]\.structured_outputs: invalid regex"):
        for out in llm.generate_stream(iter(items), use_tqdm=False, max_in_flight=2):
            seen.append(out.index)
    assert sorted(seen) == [0, 1, 2, 3, 4]


def test_stop_strings_and_parallel_samples(llm):
    S = StructuredOutputsParams
    outs = llm.generate(story_openings(3), SamplingParams(temperature=0, max_tokens=100, stop=[","], structured_outputs=SPECS[0]),
                        use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason == "," and c.text.startswith('{"name":"') and "," not in c.text
    # n = 3 with a seed: every completion follows its own matcher; the same request alone gives the same
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=160, structured_outputs=SPECS[2])
    outs = llm.generate(story_openings(5), params, use_tqdm=False)
    _assert_valid_json(outs, [SCHEMAS[2]])
    assert len({c.text for c in outs[0].outputs}) > 1
    assert _ids(llm.generate(story_openings(5)[3:4], params, use_tqdm=False)) == _ids(outs[3:4])


# ----- the engine around it: preemption, chunked prefill, aborts, interrupts ------------------------------
def _mixed_requests(n):
    prompts = story_openings(n, seed=3)
    long = " ".join(prompts)  # a prompt of several hundred tokens: chunked when the token budget is small
    prompts[0] = prompts[5] = long[:800]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=120, structured_outputs=SPECS[i % 10] if i % 3 else None,
                             n=2 if i % 7 == 0 else 1) for i in range(n)]
    return prompts, params


def test_outputs_do_not_depend_on_preemption_chunking_or_prefix_cache(stories_path):
    """The same seeded requests (constrained and not, n = 2 among them) give the same tokens on a large
    cache, on a small one preempting by recompute with chunked prefill, and on one swapping."""
    prompts, params = _mixed_requests(48)
    reference = _ids(LLM(stories_path, max_num_seqs=16, enable_prefix_caching=False).generate(prompts, params, use_tqdm=False))
    for kwargs in (dict(num_kv_blocks=40, max_num_batched_tokens=64), dict(num_kv_blocks=40, preemption_mode="swap")):
        llm = LLM(stories_path, max_num_seqs=16, enable_prefix_caching=True, **kwargs)
        assert _ids(llm.generate(prompts, params, use_tqdm=False)) == reference, kwargs
        assert llm.get_stats().num_preemptions > 0


@pytest.mark.in_process
def test_interrupted_step_and_aborts_leave_a_fresh_engine(llm, monkeypatch):
    prompts, params = _mixed_requests(12)
    reference = _ids(llm.generate(prompts, params, use_tqdm=False))
    runner = llm.llm_engine.model_runner
    execute, calls = runner.execute, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 6:
            raise KeyboardInterrupt
        return execute(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.undo()
    assert len(llm.llm_engine.grammars) == 0  # every matcher dropped with its request
    assert _ids(llm.generate(prompts, params, use_tqdm=False)) == reference
    # requests aborted mid-way lose their matchers; the rest run as they would have
    engine = llm.llm_engine
    for i in range(4):
        engine.add_request(f"r{i}", prompts[i], params[i])
    engine.step(), engine.step()
    engine.abort_request(["r1", "r2"])
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step()})
    assert [list(c.token_ids) for c in done["r3"].outputs] == reference[3] and len(engine.grammars) <= 2
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # one more step prunes the rest
    assert len(engine.grammars) == 0


def test_unconstrained_steps_do_no_grammar_work(llm, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a grammar bitmask was filled for an unconstrained batch")

    monkeypatch.setattr(manager_mod, "fill_bitmask_rows", forbidden)
    outs = llm.generate(story_openings(8), SamplingParams(temperature=0.8, seed=1, max_tokens=8), use_tqdm=False)
    assert len(outs) == 8 and len(llm.llm_engine.grammars) == 0


def test_eos_set_on_the_llm(tiny_gpt2):
    """LLM.eos_token_ids changed after construction: constraints are checked and end with the new EOS
    (13, "."), which the grammar then never writes as text; the old one (0, "!") is text again."""
    llm = LLM(tiny_gpt2, max_num_seqs=8)
    llm.eos_token_ids = frozenset([13])
    S = StructuredOutputsParams
    outs = llm.generate(tiny_prompts(4), SamplingParams(temperature=1.0, seed=3, max_tokens=8, structured_outputs=S(regex="[ab]!")), use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop" and c.token_ids[-1] == 13 and c.text in ("a!", "b!")


@pytest.mark.parametrize("overlap", [True, False])
def test_dead_end_is_reported_not_looped_on(tiny_gpt2, overlap, caplog):
    """"!" is the tiny model's EOS, so no token of its vocabulary writes "!". The regex a!b is refused
    when it is compiled; [ab]! can start but never finish: that request alone ends with EOS
    (finish_reason "stop", as vLLM's llguidance backend) and a warning naming it, the other keeps its
    output, whether the mask that finds it was filled on the helper thread or before the step."""
    llm = LLM(tiny_gpt2, max_num_seqs=8)
    llm.llm_engine.grammars.overlap = overlap
    S = StructuredOutputsParams
    with pytest.raises(ValueError, match=r"sampling_params\.structured_outputs: no token sequence of this vocabulary satisfies the regex"):
        llm.generate(tiny_prompts(1), SamplingParams(structured_outputs=S(regex="a!b")), use_tqdm=False)
    with caplog.at_level("WARNING", logger="pagedgen"):
        outs = llm.generate(tiny_prompts(3), [SamplingParams(max_tokens=8, structured_outputs=S(choice=["x", "y"])),
                                               SamplingParams(max_tokens=8, structured_outputs=S(regex="[ab]!")),
                                               SamplingParams(max_tokens=4)], use_tqdm=False)
    dead = outs[1].outputs[0]
    assert dead.finish_reason == "stop" and list(dead.token_ids[1:]) == [0] and dead.text[:1] in ("a", "b")
    assert outs[0].outputs[0].text in {"x", "y"} and outs[0].outputs[0].finish_reason == "stop"
    assert len(outs[2].outputs[0].token_ids) == 4
    assert re.search(r"request '1': .*its regex constraint .* after 1 generated tokens \('[ab]'\); the completion ends here", caplog.text, re.S)
    assert len(llm.llm_engine.grammars) == 0


# ----- the mask of a step filled on the helper thread while the model runs it --------------------
def test_mask_overlap_is_exact_and_runs_on_the_helper_thread(stories_path, monkeypatch):
    """The same seeded requests (constrained and not, n = 2, preemption by recompute, chunked
    prefill) give the same tokens with the masks filled before the forward and during it, in
    process and behind the pickled boundary; with overlap every fill runs on the one helper thread."""
    prompts, params = _mixed_requests(24)
    threads, fill = [], manager_mod.StructuredOutputManager._fill

    def recorded(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return fill(*args, **kwargs)

    monkeypatch.setattr(manager_mod.StructuredOutputManager, "_fill", recorded)
    results = {}
    for backend in (None, "pickle"):
        for overlap in (False, True):
            llm = LLM(stories_path, max_num_seqs=16, num_kv_blocks=40, max_num_batched_tokens=64, distributed_executor_backend=backend)
            llm.llm_engine.grammars.overlap = overlap
            threads.clear()
            results[backend, overlap] = _ids(llm.generate(prompts, params, use_tqdm=False))
            assert llm.get_stats().num_preemptions > 0 and threads
            assert all(name.startswith("pagedgen-mask") == overlap for name in threads), (backend, overlap, set(threads))
            grammars = llm.llm_engine.grammars
            assert grammars.num_masks > 0 and 0 < grammars.mask_wait_seconds and 0 < grammars.mask_seconds
    assert all(r == results[None, False] for r in results.values())


def test_grammar_past_the_parser_row_limit_ends_that_request_alone(tiny_gpt2, caplog):
    """A Lark grammar whose second ``x`` opens a parser row of 2,501 items (llguidance's
    max_items_in_row is 2,000) compiles and starts, then fails mid-generation: that request ends
    with EOS and a warning carrying llguidance's message; the unconstrained request keeps its output."""
    llm = LLM(tiny_gpt2, max_num_seqs=8)
    words = " | ".join(f'"w{i}" y' for i in range(2500))
    spec = StructuredOutputsParams(grammar=f'start: x x\nx: {words}\ny: "a" | "b"')
    with caplog.at_level("WARNING", logger="pagedgen"):
        outs = llm.generate(tiny_prompts(2), [SamplingParams(temperature=1.0, seed=1, max_tokens=40, structured_outputs=spec),
                                               SamplingParams(max_tokens=6)], use_tqdm=False)
    failed = outs[0].outputs[0]
    assert failed.finish_reason == "stop" and failed.token_ids[-1] == 0 and re.fullmatch(r"w\d*[ab]?", failed.text), failed.text
    assert re.search(r"request '0': llguidance failed on its grammar constraint \(.*max is 2000.*\) after \d+ generated tokens", caplog.text)
    assert len(outs[1].outputs[0].token_ids) == 6
