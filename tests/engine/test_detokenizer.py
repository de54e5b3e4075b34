"""Incremental detokenization equals a full decode; text reads on from the prompt; stop strings
cut the text where they start.

Property tests (hypothesis) feed token ids one at a time to an ``IncrementalDetokenizer`` and
compare its final text with a decode of all of them, with the GPT-2 byte-level BPE tokenizer and the
stories260K SentencePiece tokenizer (byte fallback: a CJK character or an emoji is three or four
byte tokens). Inputs are random multilingual/emoji strings, encoded, and random token ids (invalid
byte runs, special tokens in the middle). Without a prompt (``[]``) the text is
``tokenizer.decode(ids)``; with one it is ``Detokenizer.decode_in_context`` and
``decode(prompt) + text == decode(prompt + output)`` (the decode options named in each test,
always ``clean_up_tokenization_spaces=False``).
"""
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import GPT2_TOKENIZER, STORIES
from pagedgen import SamplingParams
from pagedgen.engine.detokenizer import MAX_WINDOW_TOKENS, Detokenizer

PIECES = list("abcXYZ ,.!?'\n\t  ") + list("日本語中文한국어Ελληνικάрусскийالعربيةहिन्दीéüßñ") + ["😀", "🎉", "👩‍👩‍👧", "🇫🇷", "e\u0301", "\u200d", "\ufffd", " the", "Once upon"]
TEXT = st.lists(st.sampled_from(PIECES) | st.characters(codec="utf-8"), max_size=3 * MAX_WINDOW_TOKENS).map("".join)


@pytest.fixture(scope="module", params=["gpt2", "stories260K"])
def detok(request):
    from transformers import AutoTokenizer

    path = GPT2_TOKENIZER if request.param == "gpt2" else STORIES
    if not os.path.isdir(path):
        pytest.skip(f"tokenizer not found at {path}")
    return Detokenizer(AutoTokenizer.from_pretrained(path))


def _incremental(detok: Detokenizer, ids, prompt=(), **params) -> str:
    stream = detok.stream(SamplingParams(**params), list(prompt))
    for t in ids:
        assert stream.append(t) is None
    stream.finish()
    return stream.text


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(text=TEXT, skip=st.booleans())
def test_incremental_equals_full_decode_on_text(detok, text, skip):
    ids = detok.tokenizer(text, add_special_tokens=False).input_ids
    full = detok.decode(ids, skip_special_tokens=skip)
    assert _incremental(detok, ids, skip_special_tokens=skip) == full
    if text.isprintable() and "\ufffd" not in text:
        assert "\ufffd" not in full


@SETTINGS
@given(data=st.data(), skip=st.booleans(), spaces=st.booleans())
def test_incremental_equals_full_decode_on_random_ids(detok, data, skip, spaces):
    vocab = len(detok.tokenizer)
    special = sorted(detok.special_ids)
    token = st.integers(0, vocab - 1) | st.sampled_from(special)
    ids = data.draw(st.lists(token, max_size=4 * MAX_WINDOW_TOKENS))
    full = detok.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    assert _incremental(detok, ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces) == full


@SETTINGS
@given(text=TEXT, data=st.data(), skip=st.booleans())
def test_text_reads_on_from_the_prompt(detok, text, data, skip):
    """A tokenized text cut into prompt + output anywhere (special tokens may end the prompt):
    decode(prompt) + text == decode(prompt + output), at the end and incrementally, unless the
    cut splits a character (the prompt's text then ends in U+FFFD; the two paths still agree)."""
    ids = detok.tokenizer(text).input_ids  # with BOS where the tokenizer adds one
    k = data.draw(st.integers(0, len(ids)))
    specials = data.draw(st.lists(st.sampled_from(sorted(detok.special_ids)), max_size=3))
    prompt, output = ids[:k] + specials, ids[k:]
    text_ = detok.decode_in_context(output, prompt, skip_special_tokens=skip)
    assert _incremental(detok, output, prompt, skip_special_tokens=skip) == text_
    before = detok.decode(prompt, skip_special_tokens=skip)
    if not before.endswith("\ufffd"):
        assert before + text_ == detok.decode(prompt + output, skip_special_tokens=skip)


@SETTINGS
@given(data=st.data(), skip=st.booleans(), spaces=st.booleans())
def test_incremental_equals_decode_in_context_on_random_ids(detok, data, skip, spaces):
    vocab = len(detok.tokenizer)
    token = st.integers(0, vocab - 1) | st.sampled_from(sorted(detok.special_ids))
    prompt = data.draw(st.lists(token, max_size=2 * MAX_WINDOW_TOKENS))
    output = data.draw(st.lists(token, max_size=3 * MAX_WINDOW_TOKENS))
    flags = dict(skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    assert _incremental(detok, output, prompt, **flags) == detok.decode_in_context(output, prompt, **flags)


def test_context_is_a_short_tail_of_the_prompt():
    """5 tokens of text, reaching past skipped special tokens and back to a character's first byte."""
    from transformers import AutoTokenizer

    detok = Detokenizer(AutoTokenizer.from_pretrained(STORIES))
    ids = detok.tokenizer("Once upon a time, in a big forest, there lived").input_ids
    assert detok.context(ids) == ids[-5:]
    assert detok.context([]) == [] and detok.context(ids[:3]) == ids[:3]
    eos = detok.tokenizer.eos_token_id
    assert detok.context(ids + [eos, eos]) == ids[-5:] + [eos, eos]
    assert detok.context(ids + [eos, eos], skip_special_tokens=False) == ids[-3:] + [eos, eos]
    cjk = detok.tokenizer("a 日本語", add_special_tokens=False).input_ids  # ... <0xE8> <0xAA> <0x9E>
    assert detok.tokenizer.convert_ids_to_tokens(cjk[-4:]) == ["<0xAC>", "<0xE8>", "<0xAA>", "<0x9E>"]
    assert detok.context(cjk) == cjk[-6:]  # 本語: not from <0x9C> (the middle of 本)


def test_empty_prompt_and_special_tokens_at_the_prompt_end():
    """The expected texts, spelled out (SentencePiece drops the leading space only at the start of a decode)."""
    from transformers import AutoTokenizer

    detok = Detokenizer(AutoTokenizer.from_pretrained(STORIES))
    tok = detok.tokenizer
    prompt = tok("Once upon a time, she").input_ids
    output = tok("Once upon a time, she had a big box").input_ids[len(prompt) :]
    assert tok.convert_ids_to_tokens(output[:1]) == ["▁had"]
    assert detok.decode(output) == "had a big box"  # the old, context-free text
    assert detok.decode_in_context(output, prompt) == " had a big box"
    assert detok.decode_in_context(output, []) == "had a big box"  # an empty prompt: nothing to join
    assert detok.decode_in_context(output, [tok.bos_token_id]) == "had a big box"  # decode([BOS] + output) alike
    eos = tok.eos_token_id
    assert detok.decode_in_context(output, prompt + [eos]) == " had a big box"
    assert detok.decode_in_context(output, prompt + [eos], skip_special_tokens=False) == " had a big box"
    assert detok.decode(prompt + [eos], skip_special_tokens=False) == "<s> Once upon a time, she</s>"


def test_prompt_ending_in_an_incomplete_character():
    """A token-id prompt that stops inside 日: the output's bytes complete it, the text starts with it."""
    from transformers import AutoTokenizer

    for path in (STORIES, GPT2_TOKENIZER):
        detok = Detokenizer(AutoTokenizer.from_pretrained(path))
        ids = detok.tokenizer("It is 日本 now", add_special_tokens=False).input_ids
        cut = next(k for k in range(len(ids)) if detok.decode(ids[:k]).endswith("\ufffd"))
        prompt, output = ids[:cut], ids[cut:]
        assert detok.decode_in_context(output, prompt) == detok.decode(ids)[len("It is ") :]
        assert _incremental(detok, output, prompt) == detok.decode(ids)[len("It is ") :]


def test_multibyte_character_is_not_emitted_half_done():
    """stories260K spells 日 as three byte tokens: no U+FFFD appears in the text on the way."""
    from transformers import AutoTokenizer

    detok = Detokenizer(AutoTokenizer.from_pretrained(STORIES))
    ids = detok.tokenizer("a 日本 😀 b", add_special_tokens=False).input_ids
    assert len(ids) > 8
    stream = detok.stream(SamplingParams(), [])
    seen = []
    for t in ids:
        stream.append(t)
        seen.append(stream.text)
    stream.finish()
    assert all("\ufffd" not in text for text in seen)
    assert seen[-1] == "a 日本 😀 b"


# ----- stop strings ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt2():
    from transformers import AutoTokenizer

    return Detokenizer(AutoTokenizer.from_pretrained(GPT2_TOKENIZER))


def _run_stop(detok, text, prompt="", **params):
    """Feed the tokens of ``text`` (after those of ``prompt``) until a stop string matches:
    (text, stop_reason, tokens fed)."""
    prompt_ids = detok.tokenizer(prompt, add_special_tokens=False).input_ids if prompt else []
    ids = detok.tokenizer(prompt + text, add_special_tokens=False).input_ids
    assert ids[: len(prompt_ids)] == prompt_ids
    ids = ids[len(prompt_ids) :]
    stream = detok.stream(SamplingParams(**params), prompt_ids)
    for n, t in enumerate(ids, 1):
        if stream.append(t) is not None:
            return stream.text, stream.stop_reason, n
    stream.finish()
    return stream.text, stream.stop_reason, len(ids)


def test_stop_string_inside_one_token(gpt2):
    assert gpt2.tokenizer.convert_ids_to_tokens(gpt2.tokenizer("ABCDEF").input_ids) == ["ABC", "DEF"]
    assert _run_stop(gpt2, "ABCDEF and more", stop="DE") == ("ABC", "DE", 2)
    assert _run_stop(gpt2, "ABCDEF and more", stop="DE", include_stop_str_in_output=True) == ("ABCDE", "DE", 2)


def test_stop_string_spanning_tokens(gpt2):
    text, reason, n = _run_stop(gpt2, "Hello world, this is it", stop=["lo wor"])
    assert (text, reason, n) == ("Hel", "lo wor", 2)
    assert _run_stop(gpt2, "Hello world, this is it", stop=["lo wor"], include_stop_str_in_output=True)[0] == "Hello wor"


def test_several_stop_strings_earliest_match_wins(gpt2):
    # both complete with the token " world": "o w" starts earlier than "world"
    assert _run_stop(gpt2, "Hello world, this", stop=["world", "o w"])[:2] == ("Hell", "o w")
    assert _run_stop(gpt2, "Hello world, this", stop=["is", "xyz", ", t"])[:2] == ("Hello world", ", t")


def test_stop_string_across_multibyte_tokens():
    from transformers import AutoTokenizer

    detok = Detokenizer(AutoTokenizer.from_pretrained(STORIES))
    assert _run_stop(detok, "a 日本語 b", stop="本")[:2] == ("a 日", "本")
    assert _run_stop(detok, "a 日本語 b", stop="本語", include_stop_str_in_output=True)[:2] == ("a 日本語", "本語")


def test_no_stop_string_in_the_first_min_tokens(gpt2):
    # "Hello" is token 1; with min_tokens=1 its text is not searched, the later "lo" is found
    assert _run_stop(gpt2, "Hello world, hello you", stop="lo", min_tokens=1)[:2] == ("Hello world, hel", "lo")
    assert _run_stop(gpt2, "Hello world, hello you", stop="lo")[:2] == ("Hel", "lo")


def test_stop_string_beginning_with_a_space_matches_the_first_token(gpt2):
    from transformers import AutoTokenizer

    spm = Detokenizer(AutoTokenizer.from_pretrained(STORIES))
    for detok in (gpt2, spm):
        assert _run_stop(detok, " there was", prompt="Once upon a time", stop=" there") == ("", " there", 1)
        assert _run_stop(detok, " there was", prompt="Once upon a time", stop=" there", include_stop_str_in_output=True)[:2] == (" there", " there")
        # min_tokens=1: the first token's text is not searched, the stop string's next match is
        assert _run_stop(detok, " there was there", prompt="Once", stop=" there", min_tokens=1)[:2] == (" there was", " there")


def test_no_match_leaves_the_full_text(gpt2):
    text = "Hello world, 日本 😀"
    ids = gpt2.tokenizer(text).input_ids
    assert _run_stop(gpt2, text, stop=["zzz", "Q"]) == (gpt2.decode(ids), None, len(ids))


def test_token_text_for_logprobs():
    from transformers import AutoTokenizer

    detok = Detokenizer(AutoTokenizer.from_pretrained(STORIES))
    once = detok.tokenizer.convert_tokens_to_ids("▁Once")
    assert detok.token_text(once) == " Once"
    assert detok.token_text(2) == "</s>"
