"""Structured outputs on the driver side: grammars compiled once per distinct constraint, one
matcher per constrained sequence, and the step's token bitmask.

Backend: llguidance (https://github.com/guidance-ai/llguidance), chosen over xgrammar 0.2.9 after
measuring both on our tokenizers (stories260K's SentencePiece-style vocabulary of 512 with byte
fallback; GPT-2's BPE in full and cut to the tiny test models' first 4,096 ids, EOS the text token
"!"), with the ten JSON schemas of tests/support/json_schemas.py walked by random allowed tokens
(benchmarks/grammar_backends.py; the table is in docs/structured_outputs.md):
  - coverage: all 30 llguidance walks ended in JSON valid against its schema; 5 of 30 xgrammar walks
    did not (``multipleOf`` ignored on every tokenizer, bytes that are not UTF-8 inside a
    ``maxLength`` string on stories260K, output that is not JSON on the cut GPT-2 vocabulary);
  - llguidance reports an unsatisfiable schema (minimum > maximum) or an empty language when it
    compiles, with a message, and never raises from a matcher (an error is a state, checked here);
  - compile time 0.6-1.4 ms a schema (xgrammar 1.9-9.3 ms); per-token masks cost more, 57-168 us
    on one thread of the shared test machine (xgrammar 2-18 us), so a step fills all its rows on
    llguidance's thread pool, outside the GIL;
  - one abi3 wheel with no dependencies (xgrammar brings apache-tvm-ffi).

Pieces:
    GrammarCompiler   tokenizer -> llguidance tokenizer (once), constraint -> a template matcher in
                      its start state (compiled once per distinct constraint, LRU-cached); a new
                      sequence gets a copy. ``check`` is the validation of ``add_request``.
    Grammar           one sequence's matcher: accept, validate, rollback, fill_bitmask, is_terminated
                      (the interface of STYLE.md's structured-outputs pattern).
    (manager.py: ``StructuredOutputManager``, the engine's grammars by seq id and the step's mask.)

The matcher state follows the sequence's output tokens, not its KV cache: preemption (recompute or
swap), prefix-cache hits and chunked prefill change which tokens are computed, never which are
generated, so they leave it alone. A step that raises aborts every request (``LLMEngine.step``),
and ``clear`` drops every matcher with them. EOS is allowed only where the grammar may end; a
state from which no token of the vocabulary leads on (llguidance then allows EOS alone while the
grammar is not complete), or a matcher in error mid-generation (a parser limit), ends that sequence
alone with EOS and a warning naming the request (as vLLM's llguidance backend), not a loop; ``accept``
returns why, and the engine reports it as the request's error when it asks (``on_error``).
"""
from __future__ import annotations

import collections
import json
import threading
import time
from typing import Optional

import torch

from pagedgen.structured_output import json_bounds
from pagedgen.structured_output.params import StructuredOutputsParams
from pagedgen.structured_output.vocabulary import Vocabulary

MAX_CACHED_GRAMMARS = 4096  # distinct constraints kept compiled (a per-row schema column may hold many)


_NUMBER_START = frozenset(b"0123456789-")  # a token with none of these bytes starts no JSON number and extends none
# (unless the text already ends inside one: ``Grammar.needs_guard_mask``)


def _llguidance():
    import llguidance  # imported on the first constrained request: unconstrained runs never load it
    # (not llguidance.torch: it runs torch.compile at import, seconds; its two fills are below)

    return llguidance


def fill_bitmask_rows(matchers: list, bitmask: torch.Tensor, executor=None) -> None:
    """llguidance.torch's ``fill_next_token_bitmask(_par)``: the masks of ``matchers`` [(LLMatcher,
    row)] into ``bitmask`` [R, W] int32 (CPU, contiguous), on ``executor``'s threads if given."""
    assert bitmask.dtype == torch.int32 and bitmask.is_contiguous() and bitmask.device.type == "cpu"
    row_bytes, base = bitmask.shape[1] * 4, bitmask.data_ptr()
    if executor is not None:
        executor.unsafe_compute_mask_ptr(matchers, base, row_bytes, bitmask.shape[0])
        return
    for matcher, row in matchers:  # row r starts r * row_bytes past the base (contiguous): no tensor view per row
        matcher.unsafe_compute_mask_ptr(base + row * row_bytes, row_bytes)


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint. Raises ValueError (bad GBNF) from llguidance."""
    llg = _llguidance()
    kind, text, compact = spec.key
    if kind in ("json", "json_object"):
        schema = text if kind == "json" else '{"type":"object"}'
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=json_bounds.json_defaults(compact, spec.json))
    if kind == "choice":
        return llg.LLMatcher.grammar_from_lark(choice_grammar(json.loads(text)))
    return llg.grammar_from({"regex": "regex", "grammar": "grammar"}[kind], text)


def choice_grammar(choices: list[str]) -> str:
    """The Lark grammar of a choice list: the non-empty choices as one terminal (a lexeme, matched by
    the lexer's automaton), plus "" when it is a choice. llguidance's own ``start: "a" | "b" | ...``
    puts every choice in one parser row, and more than 2,000 of them failed mid-generation (its
    ``max_items_in_row``)."""
    words = [json.dumps(c) for c in dict.fromkeys(choices) if c]  # a JSON string is a Lark string literal
    alternatives = (["CHOICE"] if words else []) + (['""'] if "" in choices else [])
    return "start: " + " | ".join(alternatives) + ("\nCHOICE: " + " | ".join(words) if words else "")


class GrammarCompiler:
    """Compiles constraints for one tokenizer and model vocabulary (shared by ``RequestProcessor``,
    which checks requests, and ``LLMEngine``, which runs them).

    Args:
        tokenizer: the model's Hugging Face tokenizer (a fast one).
        vocab_size: the model's vocabulary (logits width; the bitmask has ceil(vocab_size / 32) words).
        eos_token_ids: the tokens that end a completion (allowed where the grammar may end).
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.num_words = (vocab_size + 31) // 32
        self._vocabularies: dict[frozenset[int], Vocabulary] = {}
        self._templates: collections.OrderedDict = collections.OrderedDict()  # (key, eos) -> LLMatcher, LRU
        self._lock = threading.Lock()
        self._guarded_keys: dict[tuple, bool] = {}  # constraint key -> number guard or not (``_guarded``)
        self._closing_lengths: dict[tuple, Optional[int]] = {}  # (key, eos) -> closing walk from the start (``_start_closing_length``)
        self._executor = None
        self.num_compiled = 0  # compilations so far (a cache hit compiles nothing)
        self.compile_seconds = 0.0  # their time, without the token table's (built once per EOS set)
        self.vocabulary_seconds = 0.0

    def check(self, spec: StructuredOutputsParams, where: str) -> None:
        """Compile ``spec`` (or find it compiled). Raises ValueError ``"{where}: ..."`` with the
        backend's message: a bad schema, regex or grammar, or one no token sequence satisfies."""
        try:
            self._template(spec, self.eos_token_ids)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None

    def grammar(self, spec: StructuredOutputsParams, eos_token_ids: frozenset[int]) -> "Grammar":
        """A new matcher for ``spec`` in its start state (with the number guard of a JSON constraint)."""
        eos = frozenset(eos_token_ids)
        template, guarded = self._template(spec, eos), self._guarded(spec)
        vocab = self._vocabulary(eos)
        grammar = Grammar(template.deep_copy(), self._guard(vocab).deep_copy() if guarded else None, vocab)
        grammar.forcing = spec.kind != "grammar" or "no_forcing" not in spec.grammar
        grammar.close = spec.close_at_max_tokens and spec.kind in ("json", "json_object")
        if grammar.close:
            grammar.start_closing_length = self._start_closing_length(spec, eos, template, vocab)
        return grammar

    def _start_closing_length(self, spec: StructuredOutputsParams, eos: frozenset[int], template, vocab: Vocabulary) -> Optional[int]:
        """The closing walk's length from the start state (``closing.estimate``), once per constraint:
        a request with fewer tokens than that (and ``closing.MARGIN``) is not steered at all."""
        key = (spec.key, eos)
        if key not in self._closing_lengths:
            from pagedgen.structured_output import closing

            if len(self._closing_lengths) >= MAX_CACHED_GRAMMARS:
                self._closing_lengths.clear()
            self._closing_lengths[key] = closing.estimate(template, vocab.closing_tables(), (False, False), closing.MAX_WALK)
        return self._closing_lengths[key]

    def _guarded(self, spec: StructuredOutputsParams) -> bool:
        """A JSON constraint gets the number guard unless its schema asks for long numbers itself
        (decided once per distinct constraint: a schema walk)."""
        key = spec.key
        guarded = self._guarded_keys.get(key)
        if guarded is None:
            if len(self._guarded_keys) >= MAX_CACHED_GRAMMARS:
                self._guarded_keys.clear()
            guarded = self._guarded_keys[key] = spec.kind == "json_object" or (
                spec.kind == "json" and not json_bounds.wants_big_numbers(spec.json))
        return guarded

    def _guard(self, vocab: Vocabulary):
        """The number guard's matcher in its start state, compiled once per token table."""
        with self._lock:
            if vocab.guard is None:
                llg = _llguidance()
                vocab.guard = llg.LLMatcher(vocab.ll_tokenizer, llg.LLMatcher.grammar_from_lark(json_bounds.GUARD_LARK), log_level=0)
                if vocab.guard.is_error():  # a bug of json_bounds.GUARD_LARK, never the user's
                    raise RuntimeError(f"the JSON number guard does not compile: {_message(vocab.guard)}")
            return vocab.guard

    def executor(self):
        """llguidance's thread pool, which fills many rows of a bitmask at once outside the GIL."""
        if self._executor is None:
            self._executor = _llguidance().LLExecutor()
        return self._executor

    def _vocabulary(self, eos: frozenset[int]) -> Vocabulary:
        vocab = self._vocabularies.get(eos)
        if vocab is None:
            start = time.perf_counter()
            vocab = self._vocabularies[eos] = Vocabulary(self.tokenizer, self.vocab_size, eos)
            self.vocabulary_seconds += time.perf_counter() - start
        return vocab

    def _template(self, spec: StructuredOutputsParams, eos: frozenset[int]):
        key = (spec.key, eos)
        with self._lock:
            template = self._templates.get(key)
            if template is not None:
                self._templates.move_to_end(key)
                return template
            vocab = self._vocabulary(eos)
            start = time.perf_counter()
            llg = _llguidance()
            try:
                text = grammar_text(spec)
            except ValueError as exc:
                raise ValueError(f"invalid {spec.kind}: {exc}") from None
            template = llg.LLMatcher(vocab.ll_tokenizer, text, log_level=0)
            if template.is_error():
                raise ValueError(f"invalid {spec.kind}: {_message(template)}")
            mask = torch.zeros(1, self.num_words, dtype=torch.int32)  # an empty language shows in the first mask
            fill_bitmask_rows([(template, 0)], mask)
            if template.is_error() or (_only_eos(mask[0], vocab.eos_token_id) and not template.is_accepting()):
                raise ValueError(f"no token sequence of this vocabulary satisfies the {spec.kind} constraint")
            self.num_compiled += 1
            self.compile_seconds += time.perf_counter() - start
            self._templates[key] = template
            if len(self._templates) > MAX_CACHED_GRAMMARS:
                self._templates.popitem(last=False)
            return template


def _message(matcher) -> str:
    """llguidance's error message, without the parser-state dump it may append."""
    return matcher.get_error().split("\n<state>")[0].strip()


def _int32(word: int) -> int:
    """A 32-bit word as the signed int32 a bitmask tensor holds."""
    return word - (1 << 32) if word >= 1 << 31 else word


def _only_eos(row: torch.Tensor, eos: int) -> bool:
    """True when bitmask row [W] int32 allows token ``eos`` and nothing else (or nothing at all)."""
    allowed = row.clone()
    allowed[eos // 32] &= ~(1 << (eos % 32))
    return not bool(allowed.any())


class Grammar:
    """One sequence's matcher (an ``llguidance.LLMatcher``) over the tokens it has generated, with
    the number guard of a JSON constraint beside it (``json_bounds``; None for other kinds): a
    token is allowed where both allow it.

    The guard is fed lazily: tokens accepted while the text is outside a number wait in a list and
    reach it in one call (``guard``, the property, catches it up) when it is next needed (a mask
    inside a number, a forced chain that may touch one, a question about its state). Outside a
    number the guard allows whatever the schema allows (``json_bounds``), so it refuses none of
    them; a step of 128 rows then makes one llguidance call a token instead of two."""

    def __init__(self, matcher, guard=None, vocab: Optional[Vocabulary] = None) -> None:
        self.matcher, self._guard, self.vocab = matcher, guard, vocab
        self._unseen: list[int] = []  # accepted tokens the guard has not consumed yet
        self.token_ids: list[int] = []  # accepted so far (the guard's mask is needed only inside a number)
        self.forcing = True  # llguidance forces bytes in this grammar (False: no jump-forward; see forced_token)
        self.close = False  # steered to close its JSON near the token limit (closing.py): JSON with close_at_max_tokens
        self.closing = False  # ... from this step on (decided by StructuredOutputManager._steer_closing)
        self.next_check = 1 << 62  # the remaining tokens at or below which the closing length is next estimated
        self.start_closing_length: Optional[int] = None  # the closing walk's length from the start state (close only)

    @property
    def guard(self):
        """The number guard's matcher, caught up with every accepted token (None without one). A
        token it refuses leaves it in error (``is_error``): the next mask ends the request."""
        if self._unseen:
            self._guard.consume_tokens(self._unseen)
            self._unseen = []
        return self._guard

    def accept(self, token_ids: list[int]) -> bool:
        """Advance over ``token_ids``; False (and an error state) if the grammar refuses one."""
        ok = self.matcher.consume_tokens(token_ids)
        if ok:
            self.token_ids.extend(token_ids)
            if self._guard is not None:
                self._unseen.extend(token_ids)
                if self.needs_guard_mask():  # inside a number: the guard decides now
                    ok = not self.guard.is_error()
        return ok

    def validate(self, token_ids: list[int]) -> int:
        """How many of ``token_ids`` (a prefix) the grammar would accept, without advancing."""
        n = self.matcher.validate_tokens(token_ids)
        return n if self._guard is None else min(n, self.guard.validate_tokens(token_ids))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        for m in (self.matcher, self.guard):
            if m is not None and not m.rollback(num_tokens):
                raise RuntimeError(f"grammar rollback of {num_tokens} tokens failed: {_message(m)}")
        del self.token_ids[len(self.token_ids) - num_tokens:]

    def text(self) -> bytes:
        """The bytes of the accepted tokens."""
        tokens = self.vocab.tokens
        return b"".join([tokens[t] for t in self.token_ids])

    def needs_guard_mask(self) -> bool:
        """True when the number guard's mask may forbid a token the schema allows at this step."""
        if self._guard is None:
            return False
        last = self.vocab.tokens[self.token_ids[-1]] if self.token_ids else None
        return json_bounds.needs_guard_mask(last, self.vocab.guard_every_step)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` ([R, W] int32, CPU)."""
        fill_bitmask_rows([(self.matcher, row)], bitmask)
        if self.needs_guard_mask():
            guard = torch.empty(1, bitmask.shape[1], dtype=torch.int32)
            fill_bitmask_rows([(self.guard, 0)], guard)
            bitmask[row] &= guard[0]

    def is_terminated(self) -> bool:
        """True once the grammar has ended (EOS accepted, or no further token possible)."""
        return self.matcher.is_stopped()

    def forced_token(self) -> Optional[int]:
        """The token this state's mask would allow alone, or None. llguidance masks a state whose
        next bytes are forced with the first of ``compute_ff_tokens()`` alone (tokenparser.rs,
        ``compute_mask_inner``), the same call made here; the number guard must allow it too
        (else the step's mask is a dead end, left to the step). Kinds whose grammar may turn
        forcing off (a user's Lark ``no_forcing``) never jump (``forcing``)."""
        if not self.forcing or self.matcher.is_stopped():
            return None
        forced = self.matcher.compute_ff_tokens()
        if not forced or (self._guard is not None and self.guard.validate_tokens(forced[:1]) != 1):
            return None
        return forced[0]

    def forced_tokens(self, limit: int) -> list[int]:
        """Jump-forward decoding: the tokens the coming states force, one after the other (each
        the one token its state's mask allows: ``forced_token``), accepted into the matcher and the
        guard; at most ``limit``. The chain ends where nothing is forced, the grammar has ended, or
        the number guard refuses a token (then the tokens from that one on are rolled back: the
        step's mask decides there). The guard checks the whole chain in one call: its verdict on a
        prefix is the one it gives token by token."""
        matcher, chain = self.matcher, []
        if not self.forcing:
            return chain
        while len(chain) < limit and not matcher.is_stopped():
            forced = matcher.compute_ff_tokens()
            if not forced or not matcher.consume_tokens(forced[:1]):
                break
            chain.append(forced[0])
        if chain and self._guard is not None:
            if self.needs_guard_mask() or any(_NUMBER_START.intersection(self.vocab.tokens[t]) for t in chain):
                n = self.guard.validate_tokens(chain)  # the chain may start or extend a number: the guard decides now
                if n < len(chain):
                    if not matcher.rollback(len(chain) - n):
                        raise RuntimeError(f"grammar rollback of {len(chain) - n} tokens failed: {_message(matcher)}")
                    del chain[n:]
            self._unseen.extend(chain)  # neither starts nor extends a number: the guard allows them (class docstring)
        self.token_ids.extend(chain)
        return chain

    def is_error(self) -> bool:
        """True when the matcher or the guard is in an error state (a parser limit, a refused token)."""
        return self.matcher.is_error() or (self._guard is not None and self.guard.is_error())

    def is_accepting(self) -> bool:
        """True where the completion may end (EOS allowed by both)."""
        return self.matcher.is_accepting() and (self._guard is None or self.guard.is_accepting())

    def error_message(self) -> str:
        """The backend's message of the matcher (or guard) in error, its first line: a panic's message
        goes on with a Python traceback and a Rust backtrace, which a warning should not carry."""
        lines = _message(self.matcher if self.matcher.is_error() else self.guard).splitlines()
        return lines[0].strip() if lines else "(no message)"

    def fork(self) -> "Grammar":
        """An independent copy in the same state (a parallel sample forked from this sequence)."""
        twin = Grammar(self.matcher.deep_copy(), None if self._guard is None else self.guard.deep_copy(), self.vocab)
        twin.token_ids, twin.forcing = list(self.token_ids), self.forcing
        twin.close, twin.closing, twin.next_check = self.close, self.closing, self.next_check
        return twin
