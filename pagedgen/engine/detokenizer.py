"""Token ids -> text: whole completions, incremental detokenization, stop strings.

The text of a completion is ``tokenizer.decode(output_token_ids, skip_special_tokens=...,
spaces_between_special_tokens=..., clean_up_tokenization_spaces=False)`` (no clean-up, as in vLLM),
less the text of an EOS/stop token that ended it unless ``include_stop_str_in_output``.

Requests without stop strings decode once, when they finish (``Detokenizer.decode``). Requests with
stop strings need the text as it grows, to cut it at the first stop string: an
``IncrementalDetokenizer`` decodes, per new token, only a short window at the end (the idea of
vLLM's prefix/read offsets, after Hugging Face text-generation-inference)::

    token_ids  t0 t1 ... t[prefix] ... t[read-1] | t[read] ... t[n-1]
                         \\__ prefix_text ______/   \\__ not yet in text
    window = decode(token_ids[prefix:])    new text = window[len(prefix_text):]

Both decodes start at the same token, so what a decoder does at the start of its input (SentencePiece
strips one leading space) happens in both and cancels. These rules keep the concatenated new texts
equal to a full decode:

1. Wait while the last token is a partial one: a byte-fallback piece ``<0xNN>``, a token whose
   text alone holds U+FFFD (part of a multi-byte character), or a special token that is skipped.
   SentencePiece's ByteFallback decoder decodes a whole run of byte tokens at once (an invalid run
   becomes one U+FFFD per byte), and skipped special tokens are removed before decoding, so such a
   run must never straddle the window start.
2. Move the window start only onto a boundary where text was emitted.
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
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_SPIECE_SPACE = "\u2581"  # SentencePiece's "▁" word-start marker


class Detokenizer:
    """One tokenizer's decoding, with per-token facts cached.

    Args:
        tokenizer: a Hugging Face tokenizer (``decode``, ``convert_ids_to_tokens``).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._token_text: dict[int, str] = {}
        self._partial: dict[int, bool] = {}
        self.special_ids = frozenset(tokenizer.all_special_ids)

    def decode(self, token_ids: Seq[int], skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True) -> str:
        """The text of ``token_ids`` (no clean-up of tokenization spaces)."""
        return self.tokenizer.decode(
            list(token_ids),
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def completion_text(self, output_token_ids: Seq[int], params: SamplingParams, stopped_on_token: bool) -> str:
        """The text of a finished completion decoded at once (requests without stop strings)."""
        if stopped_on_token and not params.include_stop_str_in_output:
            output_token_ids = output_token_ids[:-1]
        return self.decode(output_token_ids, params.skip_special_tokens, params.spaces_between_special_tokens)

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

    def stream(self, params: SamplingParams) -> "IncrementalDetokenizer":
        """A new incremental detokenizer for one completion of a request."""
        return IncrementalDetokenizer(self, params)


class IncrementalDetokenizer:
    """The growing text of one completion, cut at the first stop string.

    ``append(token_id)`` after each sampled token (not for an EOS/stop token whose text is left
    out), ``finish()`` once the completion ends. ``text`` is then ``Detokenizer.decode`` of the
    appended tokens, cut at the first stop string.

    Stop strings (``params.stop``) are looked for in the text of the tokens after the first
    ``min_tokens`` ones, and only around the new text of each step (a stop string may span
    tokens or sit inside one). The earliest match in the text wins (ties: the first in ``stop``).
    """

    def __init__(self, detokenizer: Detokenizer, params: SamplingParams) -> None:
        self._detok = detokenizer
        self._skip_special = params.skip_special_tokens
        self._spaces = params.spaces_between_special_tokens
        self._stop = list(params.stop)
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._skipped = detokenizer.special_ids if params.skip_special_tokens else frozenset()
        self.token_ids: list[int] = []
        self.text = ""
        self.stop_reason: Optional[str] = None  # the stop string that cut the text
        self._prefix = 0  # window start
        self._read = 0  # token_ids[:read] are in text
        self._prefix_text = ""  # decode(token_ids[prefix:read])
        self._stop_from = 0  # stop strings are looked for in text[_stop_from:]

    def append(self, token_id: int) -> Optional[str]:
        """Add one token. Returns the stop string if the text now holds one (and cuts it there)."""
        self.token_ids.append(token_id)
        if self.stop_reason is not None or token_id in self._skipped or self._detok.is_partial(token_id):
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
        self.text += window[len(self._prefix_text) :]
        self._prefix_text = window
        if len(ids) - self._prefix > MAX_WINDOW_TOKENS:  # rule 2: move the start to the last boundary
            tail = self._decode(ids[self._read :])
            if tail:
                self._prefix, self._prefix_text = self._read, tail
        self._read = len(ids)
        if len(ids) <= self._min_tokens:
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
