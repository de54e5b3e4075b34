"""The token table llguidance matches against (``Vocabulary``), built once per tokenizer, model
vocabulary and EOS set by ``grammar.GrammarCompiler``."""
from __future__ import annotations

from pagedgen.structured_output.json_bounds import guard_unsafe_tokens

MEMO_SIZE = 65536  # byte strings whose token ids Vocabulary.__call__ keeps


class Vocabulary:
    """The token table llguidance matches against: the model's ``vocab_size`` ids, each the bytes of
    its text, special tokens and the engine's EOS ids marked special (0xFF first: never text;
    a tiny model may use a text token such as GPT-2's "!" as EOS), ids past the tokenizer's
    vocabulary special too (padding of the model's head)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        import llguidance as llg  # (the caller has imported it already: see grammar._llguidance)
        import llguidance.hf

        full = llguidance.hf.from_tokenizer(tokenizer)
        eos = sorted(t for t in eos_token_ids if t < vocab_size)
        if not eos:  # the grammar could never end the completion
            raise ValueError(f"structured outputs need an EOS token inside the vocabulary [0, {vocab_size}); the model's "
                             f"EOS ids are {sorted(eos_token_ids)} (set LLM.eos_token_ids)")
        self.eos_token_id = eos[0]
        self.eos_token_ids = eos  # the EOS ids inside the vocabulary
        self._closing = None  # closing.ClosingTables, made on first use (``closing_tables``)
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self.tokens = [
            full.decode_bytes([i]) if i < full.vocab_size and i not in eos_token_ids and not full.is_special_token(i)
            else b"\xff<[%d]>" % i
            for i in range(vocab_size)
        ]
        self.guard_every_step = guard_unsafe_tokens(self.tokens)  # json_bounds: the number guard's mask at every step
        self.guard = None  # the number guard's template matcher (GrammarCompiler._guard), made on first use
        self._full = full
        self._ids = {t: i for i, t in reversed(list(enumerate(self.tokens))) if t and t[:1] != b"\xff"}  # bytes -> lowest id
        self._longest = max(map(len, self._ids), default=1)
        self._memo: dict[bytes, list[int]] = {}  # __call__'s answers: the same forced bytes come back row after row
        self.special_token_ids = [i for i, t in enumerate(self.tokens) if t[:1] == b"\xff"]
        self.is_tokenizer_wrapper = True  # llguidance reads the table from this object and calls it (no wrapper between)
        self.ll_tokenizer = llg.LLTokenizer(self, n_vocab=vocab_size, eos_token=eos)

    def closing_tables(self):
        """The token classes that steer a JSON completion to close (structured_output/closing.py)."""
        if self._closing is None:
            from pagedgen.structured_output.closing import ClosingTables

            self._closing = ClosingTables(self.tokens, self.eos_token_ids, (len(self.tokens) + 31) // 32)
        return self._closing

    def __call__(self, text) -> list[int]:
        """Token ids of ``text`` (str or UTF-8 bytes), which llguidance asks for when a grammar
        forces some bytes (every mask of a forced state: a JSON key, the punctuation around it):
        the tokenizer's own ids (without the space a SentencePiece tokenizer puts first), or, where
        those fall outside this table, the longest tokens of the table, greedily. Memoized (up to
        ``MEMO_SIZE`` strings): the call comes from llguidance's Rust code through the GIL (this
        object is llguidance's tokenizer wrapper itself: one Python frame a call), and the same
        keys are forced in every row of a batch."""
        ids = self._memo.get(text)  # keyed by the str (llguidance's calls) or bytes as given: the two never collide
        if ids is None:
            data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
            if len(self._memo) >= MEMO_SIZE:
                self._memo.clear()
            ids = self._memo[text if isinstance(text, (str, bytes)) else data] = self._tokenize(data)
        return list(ids)

    def _tokenize(self, data: bytes) -> list[int]:
        ids = self._full.tokenize_bytes(data)
        if all(i < len(self.tokens) and self.tokens[i][:1] != b"\xff" for i in ids):
            return ids
        out, pos = [], 0
        while pos < len(data):
            for size in range(min(self._longest, len(data) - pos), 0, -1):
                token = self._ids.get(data[pos : pos + size])
                if token is not None:
                    out.append(token)
                    pos += size
                    break
            else:  # a byte no token holds: the grammar cannot produce it (llguidance then reports an error)
                raise ValueError(f"no token of the vocabulary holds the byte {data[pos:pos + 1]!r}")
        return out
