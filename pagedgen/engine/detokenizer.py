"""Token ids -> text: whole completions, incremental detokenization, stop strings.

What ``CompletionOutput.text`` is. With ``D(ids) = tokenizer.decode(ids, skip_special_tokens=...,
spaces_between_special_tokens=..., clean_up_tokenization_spaces=False)`` (the request's flags; no
clean-up, as in vLLM), ``O`` the output tokens kept (all, less an EOS/stop token that ended the
completion unless ``include_stop_str_in_output``) and ``C = context(prompt_token_ids)`` a short
tail of the prompt::

    text = D(C + O)[len(P):]    P = the longest common prefix of D(C) and D(C + O)

then cut at the first stop string. ``P`` is ``D(C)`` unless ``O`` changes the text of C's last
characters (below), so ``decode(prompt_ids) + text == decode(prompt_ids + output_ids)``: the
completion reads on from the prompt as in vLLM, the space at the join kept (SentencePiece drops a
leading space only at the start of a decode) and a character split over the join whole. Stop
strings are looked for in ``text`` only, never across the join (as vLLM).

The context ``C``: the last ``CONTEXT_TOKENS`` = 5 prompt tokens, as vLLM (its incremental
detokenizer starts with the prompt's last 5 tokens as prefix/read offsets,
``INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET``; its fast one with the last 4-23 tokens that decode
without U+FFFD), counting only tokens that are not skipped special tokens (a prompt that ends in
special tokens, as chat templates do, reaches back past them to text), and moved back over at most 3
more tokens while it would start inside a UTF-8 character spelled in byte pieces (``<0x80>`` ..
``<0xBF>``). An empty prompt has ``C = []`` and ``text = D(O)``. A short tail suffices because, with
clean-up off, a token's text depends on the tokens before it only through (1) whether it starts the
decode (SentencePiece strips one leading space off the whole text), (2) a character whose bytes
span tokens (UTF-8: at most 4 bytes, so at most 3 tokens back) and (3) skipped special tokens
(decoded as if absent, so not counted). GPT-2's byte-level BPE maps each token to bytes and decodes
them replacing invalid bytes where they are (a local rule); SentencePiece maps "▁" to a space per
piece and decodes each run of byte pieces at once. So ``D(C + O)[len(D(C)):]`` equals
``D(prompt + O)[len(D(prompt)):]`` once C holds one token of text before the join and starts on a
character boundary; 5 is vLLM's margin ("bigger = more conservative").

Where ``O`` changes the prompt's text, no ``text`` can make ``decode(prompt_ids) + text`` the joint
decode, and the formula (text from where the two decodes part) decides; only a token-id prompt or
an unusual output gets there: a prompt ending in an incomplete character (``D(C)`` ends in U+FFFD;
the output's first bytes complete it and ``text`` starts with the whole character), or, with
SentencePiece byte fallback, an output that starts with a byte that makes the prompt's trailing run
of byte pieces invalid (the run then decodes to one U+FFFD per byte).

Requests without stop strings decode once, when they finish (``Detokenizer.completion_text``).
Requests with stop strings need the text as it grows, to cut it at the first stop string: an
``IncrementalDetokenizer`` starts from C and decodes, per new token, only a short window at the end
(vLLM's prefix/read offsets, after Hugging Face text-generation-inference)::

    token_ids  C[0] ... t[prefix] ... t[read-1] | t[read] ... t[n-1]
                        \\__ prefix_text ______/   \\__ not yet in text
    window = decode(token_ids[prefix:])    new text = window[len(prefix_text):]

The window starts at C[0] with ``prefix_text = D(C)``; the first new text is taken from where the
window and ``D(C)`` part (``P`` above, the same as ``len(prefix_text)`` unless the output changed
C's text). Both decodes start at the same token, so what a decoder does at the start of its input
(SentencePiece strips one leading space) happens in both and cancels. These rules keep the
concatenated new texts equal to the formula above:

1. Wait while the last token is a partial one: a byte-fallback piece ``<0xNN>``, a token whose
   text alone holds U+FFFD (part of a multi-byte character), or a special token that is skipped.
   SentencePiece's ByteFallback decoder decodes a whole run of byte tokens at once (an invalid run
   becomes one U+FFFD per byte), and skipped special tokens are removed before decoding, so such a
   run must never straddle the window start.
2. Move the window start only onto a boundary where text was emitted; the first such boundary is C's
   end less its trailing partial tokens (a character the prompt left unfinished stays in the window).
3. Guards for decoders unlike the two tested (GPT-2 byte-level BPE, SentencePiece with byte
   fallback), where rules 1-2 already suffice: wait while the window ends in U+FFFD, and do not
   move the start onto tokens that decode to nothing (their leading-space strip would bite into
   the new text).

The window is moved forward once it holds more than ``MAX_WINDOW_TOKENS`` tokens, so a step decodes
a handful of tokens once (and, every few steps, once more), not the whole completion.
"""
from __future__ import annotations

import re
from typing import Optional, Sequence as Seq

from pagedgen.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"
MAX_WINDOW_TOKENS = 8
#: Prompt tokens (not counting skipped special tokens) decoded before the output: vLLM's
#: ``INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET``.
CONTEXT_TOKENS = 5
_MAX_CHAR_TOKENS = 3  # a UTF-8 character has at most 3 bytes after its first
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPIECE_SPACE = "\u2581"  # SentencePiece's "▁" word-start marker


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


class Detokenizer:
    """One tokenizer's decoding, with per-token facts cached.

    Args:
        tokenizer: a Hugging Face tokenizer (``decode``, ``convert_ids_to_tokens``).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._token_text: dict[int, str] = {}
        self._partial: dict[int, bool] = {}
        self._continuation: dict[int, bool] = {}
        self.special_ids = frozenset(tokenizer.all_special_ids)

    def decode(self, token_ids: Seq[int], skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True) -> str:
        """The text of ``token_ids`` (no clean-up of tokenization spaces)."""
        return self.tokenizer.decode(
            list(token_ids),
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def context(self, prompt_token_ids: Seq[int], skip_special_tokens: bool = True) -> list[int]:
        """``C``, the tail of the prompt that output text is decoded after (module docstring): the
        last ``CONTEXT_TOKENS`` tokens that are not skipped special tokens, moved back off the
        middle of a character spelled in byte pieces. ``[]`` for an empty prompt."""
        skipped = self.special_ids if skip_special_tokens else frozenset()
        start, counted = len(prompt_token_ids), 0
        while start > 0 and counted < CONTEXT_TOKENS:
            start -= 1
            counted += prompt_token_ids[start] not in skipped
        for _ in range(_MAX_CHAR_TOKENS):
            if start == 0 or not self.is_continuation(prompt_token_ids[start]):
                break
            start -= 1
        return list(prompt_token_ids[start:])

    def decode_in_context(
        self,
        output_token_ids: Seq[int],
        prompt_token_ids: Seq[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> str:
        """The text of ``output_token_ids`` as it reads on from the prompt: ``D(C + O)[len(P):]``
        (module docstring), so ``decode(prompt) + text == decode(prompt + output)``."""
        ctx = self.context(prompt_token_ids, skip_special_tokens)
        if not ctx:
            return self.decode(output_token_ids, skip_special_tokens, spaces_between_special_tokens)
        before = self.decode(ctx, skip_special_tokens, spaces_between_special_tokens)
        joint = self.decode(ctx + list(output_token_ids), skip_special_tokens, spaces_between_special_tokens)
        return joint[_common_prefix_len(before, joint) :]

    def completion_text(self, output_token_ids: Seq[int], params: SamplingParams, stopped_on_token: bool, *, prompt_token_ids: Seq[int]) -> str:
        """The text of a finished completion decoded at once (requests without stop strings), in
        the context of ``prompt_token_ids``; an EOS/stop token that ended it (``stopped_on_token``)
        is left out unless ``params.include_stop_str_in_output``."""
        if stopped_on_token and not params.include_stop_str_in_output:
            output_token_ids = output_token_ids[:-1]
        return self.decode_in_context(output_token_ids, prompt_token_ids, params.skip_special_tokens, params.spaces_between_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (``Logprob.decoded_token``), special tokens included.
        A SentencePiece piece that starts a word keeps its leading space, which decode() drops."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and piece.startswith(_SPIECE_SPACE) and not text.startswith(" "):
                text = " " + text
            self._token_text[token_id] = text
        return text

    def is_partial(self, token_id: int) -> bool:
        """True for a token whose text depends on the tokens after it (rule 1 above)."""
        partial = self._partial.get(token_id)
        if partial is None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            alone = self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            partial = bool(isinstance(piece, str) and _BYTE_PIECE.fullmatch(piece)) or REPLACEMENT_CHAR in alone
            self._partial[token_id] = partial
        return partial

    def is_continuation(self, token_id: int) -> bool:
        """True for a byte-fallback piece ``<0x80>`` .. ``<0xBF>``: not the first byte of a character."""
        cont = self._continuation.get(token_id)
        if cont is None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            m = _BYTE_PIECE.fullmatch(piece) if isinstance(piece, str) else None
            cont = m is not None and 0x80 <= int(m.group(1), 16) <= 0xBF
            self._continuation[token_id] = cont
        return cont

    def stream(self, params: SamplingParams, prompt_token_ids: Seq[int]) -> "IncrementalDetokenizer":
        """A new incremental detokenizer for one completion of a request with prompt ``prompt_token_ids``."""
        return IncrementalDetokenizer(self, params, prompt_token_ids)


class IncrementalDetokenizer:
    """The growing text of one completion, cut at the first stop string.

    ``append(token_id)`` after each sampled token (not for an EOS/stop token whose text is left
    out), ``finish()`` once the completion ends. ``text`` is then
    ``Detokenizer.decode_in_context`` of the appended tokens, cut at the first stop string.

    Stop strings (``params.stop``) are looked for in the text of the tokens after the first
    ``min_tokens`` ones, and only around the new text of each step (a stop string may span
    tokens or sit inside one). The earliest match in the text wins (ties: the first in ``stop``).

    Args:
        detokenizer: the tokenizer's ``Detokenizer``.
        params: the request's SamplingParams (stop, include_stop_str_in_output, min_tokens,
            skip_special_tokens, spaces_between_special_tokens).
        prompt_token_ids: the prompt; only its tail ``Detokenizer.context`` is kept.
    """

    def __init__(self, detokenizer: Detokenizer, params: SamplingParams, prompt_token_ids: Seq[int]) -> None:
        self._detok = detokenizer
        self._skip_special = params.skip_special_tokens
        self._spaces = params.spaces_between_special_tokens
        self._stop = list(params.stop)
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._skipped = detokenizer.special_ids if params.skip_special_tokens else frozenset()
        context = detokenizer.context(prompt_token_ids, params.skip_special_tokens)
        self._num_context = len(context)
        self.token_ids: list[int] = context  # the context C, then the appended tokens
        self.text = ""
        self.stop_reason: Optional[str] = None  # the stop string that cut the text
        self._prefix = 0  # window start
        self._prefix_text = self._decode(context) if context else ""  # decode(token_ids[prefix:]) at the last emission
        # token_ids[:read] are settled in text: C less its trailing partial tokens (rule 2)
        self._read = len(context)
        while self._read > 0 and self._held(context[self._read - 1]):
            self._read -= 1
        self._emitted = False  # the first emission takes its new text from where it parts from D(C)
        self._stop_from = 0  # stop strings are looked for in text[_stop_from:]

    def _held(self, token_id: int) -> bool:
        return token_id in self._skipped or self._detok.is_partial(token_id)

    def append(self, token_id: int) -> Optional[str]:
        """Add one token. Returns the stop string if the text now holds one (and cuts it there)."""
        self.token_ids.append(token_id)
        if self.stop_reason is not None or self._held(token_id):
            return None
        return self._emit(final=False)

    def finish(self) -> Optional[str]:
        """Decode what is still held back (an incomplete character, byte tokens). Returns the stop
        string if the text now holds one."""
        if self.stop_reason is not None or self._read == len(self.token_ids):
            return None
        return self._emit(final=True)

    def _decode(self, token_ids: list[int]) -> str:
        return self._detok.decode(token_ids, self._skip_special, self._spaces)

    def _emit(self, final: bool) -> Optional[str]:
        ids = self.token_ids
        window = self._decode(ids[self._prefix :])
        if not final and window.endswith(REPLACEMENT_CHAR):
            return None  # rule 3
        new_from = len(self.text)
        start = len(self._prefix_text) if self._emitted else _common_prefix_len(self._prefix_text, window)
        self.text += window[start:]
        self._prefix_text, self._emitted = window, True
        if len(ids) - self._prefix > MAX_WINDOW_TOKENS:  # rule 2: move the start to the last boundary
            tail = self._decode(ids[self._read :])
            if tail:
                self._prefix, self._prefix_text = self._read, tail
        self._read = len(ids)
        if len(ids) - self._num_context <= self._min_tokens:
            self._stop_from = len(self.text)
            return None
        return self._find_stop(new_from) if self._stop else None

    def _find_stop(self, new_from: int) -> Optional[str]:
        text = self.text
        begin = max(self._stop_from, new_from - self._max_stop_len + 1)
        best: Optional[tuple[int, str]] = None
        for s in self._stop:
            i = text.find(s, begin)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = text[: i + len(s)] if self._include_stop else text[:i]
        self.stop_reason = s
        return s
