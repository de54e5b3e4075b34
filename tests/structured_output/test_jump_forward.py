"""Jump-forward decoding (issue 51): the tokens a grammar forces (JSON keys, punctuation, the rest
of an enum value) are appended without a decode step each and computed with the next position as
a short chunk; the outputs are those of token-by-token decoding under the same masks, greedy and
seeded, in process and behind the pickled executor boundary, with preemption; the steps saved and
the tokens so appended are counted in get_stats()."""
import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from json_schemas import SCHEMAS

from pagedgen import LLM, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

S = StructuredOutputsParams
SPECS = [S(json=s) for s in SCHEMAS] + [S(json=SCHEMAS[3], disable_any_whitespace=True), S(choice=["apple pie", "banana split"]),
                                         S(regex=r"key-(alpha|beta)-[0-9]{2}")]


def _params(temperature: float, logprobs=None):
    return [SamplingParams(temperature=temperature, seed=i, max_tokens=100, structured_outputs=SPECS[i % len(SPECS)], logprobs=logprobs)
            for i in range(2 * len(SPECS))]


def _run(llm, params, jump: bool):
    grammars = llm.llm_engine.grammars
    grammars.jump_forward = jump
    try:
        before = llm.get_stats()
        outs = llm.generate(["Once upon a time"] * len(params), params, use_tqdm=False)
        after = llm.get_stats()
    finally:
        grammars.jump_forward = True
    return outs, after.num_steps - before.num_steps, after.num_jump_forward_tokens - before.num_jump_forward_tokens


def _same(a, b):
    assert [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].logprobs) for o in a] == \
           [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].logprobs) for o in b]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_jump_forward_gives_the_token_by_token_outputs_in_fewer_steps(llm, temperature):
    params = _params(temperature)
    jumped, steps, forced = _run(llm, params, True)
    plain, plain_steps, none = _run(llm, params, False)
    _same(jumped, plain)
    generated = sum(len(o.outputs[0].token_ids) for o in jumped)
    assert none == 0 and 0.1 * generated < forced < generated  # keys and punctuation are a good share of JSON
    assert steps < plain_steps
    for o, p in zip(jumped, params):
        if o.outputs[0].finish_reason == "stop" and p.structured_outputs.json is not None:
            jsonschema.validate(__import__("json").loads(o.outputs[0].text), p.structured_outputs.json)


def test_no_jump_where_logprobs_are_asked_for(llm):
    params = _params(1.0, logprobs=2)[:6]
    jumped, _, forced = _run(llm, params, True)
    plain, _, _ = _run(llm, params, False)
    assert forced == 0
    _same(jumped, plain)


def test_jump_forward_behind_the_pickled_boundary_with_preemption(stories_path):
    """The forced tokens reach the worker with the step's token ids (no decode token travels
    down otherwise); a small KV cache preempts (recompute) mid-JSON."""
    params = _params(1.0)[:12]
    small = LLM(stories_path, distributed_executor_backend="pickle", num_kv_blocks=12, max_model_len=160, max_num_seqs=12, max_num_batched_tokens=64)
    jumped, _, forced = _run(small, params, True)
    assert forced > 0 and small.get_stats().num_preemptions > 0
    plain, _, _ = _run(small, params, False)
    _same(jumped, plain)
    reference, _, _ = _run(LLM(stories_path), params, False)
    _same(jumped, reference)


@pytest.mark.parametrize("vocabulary", ["stories260K", "gpt2"])
def test_a_forced_token_is_the_one_token_its_state_s_mask_allows(llm, vocabulary):
    """Random walks over the schemas (and a choice, a regex), on stories260K's vocabulary and
    GPT-2's: wherever the grammar names a forced token, llguidance's mask of that state (matcher
    and number guard) allows it alone; and where it names none, the mask allows more than one token
    or EOS (no forced step is missed)."""
    import os
    import random

    import torch

    from conftest import GPT2_TOKENIZER
    from pagedgen.structured_output.grammar import GrammarCompiler

    if vocabulary == "stories260K":
        compiler, eos = llm.processor.grammars, frozenset(llm.eos_token_ids)
    else:
        if not os.path.isdir(GPT2_TOKENIZER):
            pytest.skip(f"tokenizer not found at {GPT2_TOKENIZER}")
        from transformers import AutoTokenizer

        compiler, eos = GrammarCompiler(AutoTokenizer.from_pretrained(GPT2_TOKENIZER), 50257, frozenset([50256])), frozenset([50256])
    rng, forced_states = random.Random(0), 0
    for spec in SPECS:
        g = compiler.grammar(spec, eos)
        for _ in range(60):
            if g.matcher.is_stopped():
                break
            probe = g.fork()  # the mask is computed on a copy: forced_token's call must not feed it
            row = torch.zeros(1, compiler.num_words, dtype=torch.int32)
            probe.fill_bitmask(row, 0)
            allowed = [32 * w + b for w, word in enumerate(row[0].tolist()) for b in range(32) if (word >> b) & 1]
            token = g.forced_token()
            if token is not None:
                assert allowed == [token], (spec, token, allowed)
                forced_states += 1
            else:
                assert len(allowed) > 1 or set(allowed) <= eos, (spec, allowed)
            choice = token if token is not None else rng.choice(allowed)
            if choice in eos:
                break
            assert g.accept([choice])
    assert forced_states > 50


def test_a_forced_chain_is_the_token_by_token_one_and_the_lazy_guard_keeps_up(llm):
    """``Grammar.forced_tokens`` (one call per chain, the number guard fed lazily) accepts what
    ``forced_token`` + ``accept`` token by token did, on random walks over the schemas; the guard,
    caught up, is in the state of a guard fed every token (the same tokens valid next)."""
    import random

    from pagedgen.structured_output.grammar import Grammar

    compiler, eos = llm.processor.grammars, frozenset(llm.eos_token_ids)
    rng, chained = random.Random(1), 0
    for spec in SPECS:
        fast, slow = compiler.grammar(spec, eos), compiler.grammar(spec, eos)
        eager = None if fast._guard is None else fast._guard.deep_copy()  # fed every token, as before the lazy guard
        for _ in range(40):
            chain = fast.forced_tokens(8)
            step_by_step = []
            while len(step_by_step) < 8 and (token := slow.forced_token()) is not None:
                assert slow.accept([token])
                step_by_step.append(token)
            assert chain == step_by_step, spec
            chained += len(chain)
            if fast.matcher.is_stopped():
                break
            row = __import__("torch").zeros(1, compiler.num_words, dtype=__import__("torch").int32)
            fast.fork().fill_bitmask(row, 0)
            allowed = [32 * w + b for w, word in enumerate(row[0].tolist()) for b in range(32) if (word >> b) & 1]
            choice = rng.choice(allowed)
            if choice in eos:
                break
            assert fast.accept([choice]) and slow.accept([choice])
            if eager is not None:
                assert eager.consume_tokens(chain + [choice])
                probe = [t for t in range(0, compiler.vocab_size, 7)]
                assert [fast.guard.validate_tokens([t]) for t in probe] == [eager.validate_tokens([t]) for t in probe]
        assert isinstance(fast, Grammar)
    assert chained > 50


def test_mask_overlap_is_chosen_where_it_pays(llm, monkeypatch):
    """``overlap=None`` (the default): serial while a step's fill is small (stories260K's masks), on
    the helper thread once it is large and a core is free for it (a GPU runs the forward, or torch
    leaves a core idle); True and False decide alone."""
    import torch

    from pagedgen.structured_output import manager as manager_mod

    grammars = manager_mod.StructuredOutputManager(llm.processor.grammars, overlap=None)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=30, structured_outputs=SPECS[i % len(SPECS)]) for i in range(8)]
    llm.llm_engine.grammars, real = grammars, llm.llm_engine.grammars
    try:
        llm.generate(["Once upon a time"] * len(params), params, use_tqdm=False)
    finally:
        llm.llm_engine.grammars = real
    assert grammars._fill_mean > 0  # measured
    monkeypatch.setattr(manager_mod, "_num_cores", lambda: 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    grammars.forward_on_host, grammars._fill_mean = False, 0.5 * manager_mod.OVERLAP_MIN_FILL_SECONDS
    assert not grammars.overlaps()  # a small fill: not worth the hand-off, even with cores to spare
    grammars.forward_on_host, grammars._fill_mean = True, 1.0  # a slow fill
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert not grammars.overlaps()  # the forward holds every core
    grammars.forward_on_host = False
    assert grammars.overlaps()  # a GPU runs it
    grammars.forward_on_host = True
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert grammars.overlaps()  # a core to spare
    grammars.overlap = False
    assert not grammars.overlaps()
    grammars.overlap, grammars._fill_mean = True, 0.0
    assert grammars.overlaps()
