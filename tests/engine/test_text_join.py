"""``prompt + text`` reads as the decode of prompt and output together, as in vLLM (issue 15 item 3).

For 100 sampled completions with each tokenizer — stories260K (SentencePiece with byte fallback,
the real model) and GPT-2's byte-level BPE (a tiny random-weight Llama with vocabulary 50257, built
here, so the outputs are random tokens: odd pieces, partial characters, the odd EOS):

    prompt + text == tokenizer.decode(prompt_ids + kept_ids, skip_special_tokens=skip,
                                      clean_up_tokenization_spaces=False)

with ``spaces_between_special_tokens`` at its default (True), ``skip`` the request's
``skip_special_tokens`` (with ``skip=False`` the prompt's text is ``decode(prompt_ids,
skip_special_tokens=False)``, which holds BOS) and ``kept_ids`` the output token ids less an EOS that
ended the completion (unless ``include_stop_str_in_output``). With stop strings (drawn from each
completion's own text, one in four beginning with a space at the first generated token), ``prompt +
text`` is that full decode cut at the first stop string found after the text of the first
``min_tokens`` tokens (before it, or after it with ``include_stop_str_in_output``), and the output
ends with the token that completed it. Seeds per request make all of it reproducible.
"""
import random

import pytest

from conftest import GPT2_TOKENIZER, story_openings
from pagedgen import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")
NUM = 100
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def gpt2_llm(tmp_path_factory):
    """A random-weight Llama (vocab 50257, hidden 16, 1 layer) with the GPT-2 tokenizer's files."""
    import os

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if not os.path.isdir(GPT2_TOKENIZER):
        pytest.skip(f"tokenizer not found at {GPT2_TOKENIZER}")
    folder = str(tmp_path_factory.mktemp("gpt2_llama"))
    tok = AutoTokenizer.from_pretrained(GPT2_TOKENIZER)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=256, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return LLM(folder, max_num_seqs=NUM)


@pytest.fixture(scope="module", params=["stories260K", "gpt2"])
def model(request, llm, gpt2_llm):
    return llm if request.param == "stories260K" else gpt2_llm


def _decode(llm, ids, skip):
    return llm.tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def _kept(out, include):
    """The output ids whose text is in ``text``: an EOS that ended it is left out unless included."""
    ids = out.token_ids
    if out.finish_reason == "stop" and out.stop_reason is None and not include:
        return ids[:-1]
    return ids


def _prompt_text(llm, res, skip):
    return res.prompt if skip else _decode(llm, res.prompt_token_ids, False)


@pytest.fixture(scope="module")
def plain(model):
    """The 100 completions without stop strings: (prompt results, parameters)."""
    prompts = story_openings(NUM)
    params = [
        SamplingParams(temperature=0.9, seed=i, max_tokens=MAX_TOKENS, skip_special_tokens=i % 5 != 0, include_stop_str_in_output=i % 7 == 0)
        for i in range(NUM)
    ]
    results = model.generate(prompts, params, use_tqdm=False)
    for res in results:  # the prompts are texts the tokenizer gives back unchanged
        assert _decode(model, res.prompt_token_ids, True) == res.prompt
    return results, params


def test_prompt_plus_text_is_the_joint_decode(model, plain):
    results, params = plain
    joins_with_space = 0
    for res, sp in zip(results, params):
        out = res.outputs[0]
        skip = sp.skip_special_tokens
        full = _decode(model, res.prompt_token_ids + _kept(out, sp.include_stop_str_in_output), skip)
        assert _prompt_text(model, res, skip) + out.text == full, (res.prompt, out.token_ids)
        joins_with_space += out.text.startswith(" ")
    assert joins_with_space >= NUM // 4  # the join the old context-free decode got wrong is common here


def _first_token_text(llm, res, skip):
    """The text of the first output token after the prompt, when it begins with a space and is
    whole (not part of a character), else None."""
    ids = res.outputs[0].token_ids
    if not ids or llm.detokenizer.is_partial(ids[0]):
        return None
    prompt_text = _prompt_text(llm, res, skip)
    first = _decode(llm, res.prompt_token_ids + ids[:1], skip)[len(prompt_text) :]
    return first if first.startswith(" ") else None


def _draw_stops(rng: random.Random, text: str, first: str) -> list[str]:
    """One or two stop strings taken from ``text``: a prefix of the first token's text ``first``
    when given, else from a random character or a random space on."""
    if first:
        return [first[: rng.randint(1, 4)]]
    if not text.strip():
        return ["never in it"]
    spaces = [k for k, c in enumerate(text) if c == " "]
    pos = rng.choice(spaces) if spaces and rng.random() < 0.5 else rng.randrange(len(text))
    stop = text[pos : pos + rng.randint(1, 4)]
    return [stop] if rng.random() < 0.5 else [f"{stop}#absent#", stop]


def test_prompt_plus_text_is_the_joint_decode_cut_at_the_stop_string(model, plain):
    results, params = plain
    detok = model.detokenizer
    rng = random.Random(15)
    stop_params, firsts = [], []
    for i, (res, sp) in enumerate(zip(results, params)):
        out = res.outputs[0]
        first = _first_token_text(model, res, sp.skip_special_tokens) if i % 4 == 0 else None
        stops = _draw_stops(rng, out.text, first)
        firsts.append(first)
        min_tokens = 0 if first else rng.choice([0, 0, 1, 2])
        if min_tokens and (len(out.token_ids) < min_tokens or detok.is_partial(out.token_ids[min_tokens - 1])):
            min_tokens = 0  # the searched text then starts at a token boundary the test can compute
        stop_params.append(sp.clone(stop=stops, min_tokens=min_tokens, include_stop_str_in_output=rng.random() < 0.3))
    stopped = model.generate([res.prompt for res in results], stop_params, use_tqdm=False)

    matched = first_token_matches = 0
    for i, (res, sp) in enumerate(zip(stopped, stop_params)):
        out, skip, include = res.outputs[0], sp.skip_special_tokens, sp.include_stop_str_in_output
        prompt_ids, ids = res.prompt_token_ids, out.token_ids
        prompt_text = _prompt_text(model, res, skip)
        full = _decode(model, prompt_ids + _kept(out, include), skip)
        search_from = len(_decode(model, prompt_ids + ids[: sp.min_tokens], skip)) if sp.min_tokens else len(prompt_text)
        hits = sorted((full.find(s, search_from), k, s) for k, s in enumerate(sp.stop) if full.find(s, search_from) != -1)
        if hits:
            at, _, s = hits[0]
            assert (out.finish_reason, out.stop_reason) == ("stop", s)
            assert prompt_text + out.text == full[: at + len(s) if include else at], (res.prompt, ids, sp.stop)
            # it stopped at the token that completed the stop string: not already in the text of
            # the tokens up to the last one before it that emits text
            last = max((k for k in range(len(ids) - 1) if not detok.is_partial(ids[k]) and ids[k] not in detok.special_ids), default=-1)
            before = _decode(model, prompt_ids + ids[: last + 1], skip)
            assert all(before.find(s, search_from) == -1 for s in sp.stop)
            matched += 1
            if firsts[i]:  # a stop string beginning with a space matches the first generated token
                assert out.text == (s if include else "") and len(ids) == 1
                first_token_matches += 1
        else:
            assert not isinstance(out.stop_reason, str)
            assert prompt_text + out.text == full
    assert matched >= NUM * 3 // 4 and first_token_matches >= 10
