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
    StructuredOutputManager  the engine's grammars by seq id: ``add`` when a request is queued,
                      ``bitmask(batch)`` when the step is scheduled (the rows are filled on one
                      helper thread while the forward runs; the sampler's read waits for them),
                      ``accept`` after sampling, ``clear`` on rollback.

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
import concurrent.futures
import json
import logging
import os
import threading
import time
from typing import Optional

import torch

from pagedgen.structured_output.params import StructuredOutputsParams
from pagedgen.structured_output.token_bitmask import GrammarBitmask

logger = logging.getLogger("pagedgen")

MAX_CACHED_GRAMMARS = 4096  # distinct constraints kept compiled (a per-row schema column may hold many)
#: fill each step's bitmask on one helper thread while the model runs the step (PAGEDGEN_MASK_OVERLAP=0: before it, serially)
MASK_OVERLAP = os.environ.get("PAGEDGEN_MASK_OVERLAP", "1") != "0"
PARALLEL_ROWS = 16  # masks of this many rows or more are filled on llguidance's thread pool (fewer: one by one is faster)


def _llguidance():
    import llguidance  # imported on the first constrained request: unconstrained runs never load it
    # (not llguidance.torch: it runs torch.compile at import, seconds; its two fills are below)

    return llguidance


def fill_bitmask_rows(matchers: list, bitmask: torch.Tensor, executor=None) -> None:
    """llguidance.torch's ``fill_next_token_bitmask(_par)``: the masks of ``matchers`` [(LLMatcher,
    row)] into ``bitmask`` [R, W] int32 (CPU, contiguous), on ``executor``'s threads if given."""
    assert bitmask.dtype == torch.int32 and bitmask.is_contiguous() and bitmask.device.type == "cpu"
    row_bytes = bitmask.shape[1] * 4
    if executor is not None:
        executor.unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), row_bytes, bitmask.shape[0])
        return
    for matcher, row in matchers:
        matcher.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), row_bytes)


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint. Raises ValueError (bad GBNF) from llguidance."""
    llg = _llguidance()
    kind, text, compact = spec.key
    if kind in ("json", "json_object"):
        schema = text if kind == "json" else '{"type":"object"}'
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": not compact})
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


class _Vocabulary:
    """The token table llguidance matches against: the model's ``vocab_size`` ids, each the bytes of
    its text, special tokens and the engine's EOS ids marked special (0xFF first: never text;
    a tiny model may use a text token such as GPT-2's "!" as EOS), ids past the tokenizer's
    vocabulary special too (padding of the model's head)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        llg = _llguidance()
        import llguidance.hf

        full = llguidance.hf.from_tokenizer(tokenizer)
        eos = sorted(t for t in eos_token_ids if t < vocab_size)
        if not eos:  # the grammar could never end the completion
            raise ValueError(f"structured outputs need an EOS token inside the vocabulary [0, {vocab_size}); the model's "
                             f"EOS ids are {sorted(eos_token_ids)} (set LLM.eos_token_ids)")
        self.eos_token_id = eos[0]
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self.tokens = [
            full.decode_bytes([i]) if i < full.vocab_size and i not in eos_token_ids and not full.is_special_token(i)
            else b"\xff<[%d]>" % i
            for i in range(vocab_size)
        ]
        self.special_token_ids = [i for i, t in enumerate(self.tokens) if t[:1] == b"\xff"]
        self._full = full
        self._ids = {t: i for i, t in reversed(list(enumerate(self.tokens))) if t and t[:1] != b"\xff"}  # bytes -> lowest id
        self._longest = max(map(len, self._ids), default=1)
        self.ll_tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(self), n_vocab=vocab_size, eos_token=eos)

    def __call__(self, text) -> list[int]:
        """Token ids of ``text`` (str or UTF-8 bytes), which llguidance asks for when a grammar
        forces some bytes: the tokenizer's own ids (without the space a SentencePiece tokenizer puts
        first), or, where those fall outside this table, the longest tokens of the table, greedily."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
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
        self._vocabularies: dict[frozenset[int], _Vocabulary] = {}
        self._templates: collections.OrderedDict = collections.OrderedDict()  # (key, eos) -> LLMatcher, LRU
        self._lock = threading.Lock()
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
        """A new matcher for ``spec`` in its start state."""
        return Grammar(self._template(spec, frozenset(eos_token_ids)).deep_copy())

    def executor(self):
        """llguidance's thread pool, which fills many rows of a bitmask at once outside the GIL."""
        if self._executor is None:
            self._executor = _llguidance().LLExecutor()
        return self._executor

    def _vocabulary(self, eos: frozenset[int]) -> _Vocabulary:
        vocab = self._vocabularies.get(eos)
        if vocab is None:
            start = time.perf_counter()
            vocab = self._vocabularies[eos] = _Vocabulary(self.tokenizer, self.vocab_size, eos)
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
    """One sequence's matcher (an ``llguidance.LLMatcher``) over the tokens it has generated."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher

    def accept(self, token_ids: list[int]) -> bool:
        """Advance over ``token_ids``; False (and an error state) if the grammar refuses one."""
        return self.matcher.consume_tokens(token_ids)

    def validate(self, token_ids: list[int]) -> int:
        """How many of ``token_ids`` (a prefix) the grammar would accept, without advancing."""
        return self.matcher.validate_tokens(token_ids)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        if not self.matcher.rollback(num_tokens):
            raise RuntimeError(f"grammar rollback of {num_tokens} tokens failed: {_message(self.matcher)}")

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` ([R, W] int32, CPU)."""
        fill_bitmask_rows([(self.matcher, row)], bitmask)

    def is_terminated(self) -> bool:
        """True once the grammar has ended (EOS accepted, or no further token possible)."""
        return self.matcher.is_stopped()

    def fork(self) -> "Grammar":
        """An independent copy in the same state (a parallel sample forked from this sequence)."""
        return Grammar(self.matcher.deep_copy())


class StructuredOutputManager:
    """The grammars of the engine's constrained sequences, by seq id.

    Nothing here runs for a step while no queued request is constrained: ``bitmask`` returns None
    at once and ``accept`` returns at once.
    """

    def __init__(self, compiler: GrammarCompiler, overlap: bool = MASK_OVERLAP) -> None:
        self.compiler = compiler
        self.overlap = overlap  # fill masks on the helper thread during the forward (see ``bitmask``)
        self._grammars: dict[int, tuple] = {}  # seq_id -> (Sequence, Grammar)
        self._thread: Optional[concurrent.futures.ThreadPoolExecutor] = None  # one helper thread, made on first use
        self._pending: Optional[GrammarBitmask] = None  # the step's mask while its fill may still run
        self._dead: dict[int, str] = {}  # seq id -> why, given EOS alone in this step (dead ends: see _check_dead_ends)
        self.mask_seconds = 0.0  # time spent filling bitmasks (benchmarks/structured.py reports it)
        self.mask_wait_seconds = 0.0  # time the step waited for them (all of mask_seconds when serial)
        self.num_masks = 0

    def __len__(self) -> int:
        return len(self._grammars)

    def add(self, seq) -> None:
        """Give a newly queued sequence its matcher if its request is constrained."""
        spec = seq.sampling_params.structured_outputs
        if spec is not None:
            self._grammars[seq.seq_id] = (seq, self.compiler.grammar(spec, seq.eos_token_ids))

    def clear(self) -> None:
        """Forget every matcher (the engine aborted every request), after any fill still running."""
        self._join(raise_errors=False)
        self._grammars.clear()
        self._dead.clear()

    def _join(self, raise_errors: bool = True) -> None:
        """Wait for the last step's fill (the sampler has waited for it already unless the step failed)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.wait()
            except Exception:
                if raise_errors:
                    raise

    def bitmask(self, batch) -> Optional[GrammarBitmask]:
        """The bitmask rows of the constrained sequences that sample in ``batch`` (a ScheduledBatch
        whose parallel samples are forked already), or None when there are none. Matchers of
        finished or aborted sequences are dropped here; forked children get a copy of their parent's.

        With ``overlap`` the rows are filled on the helper thread (llguidance drops the GIL) and
        the returned mask is pending: the sampler's read of ``bitmask`` waits for it, after the
        forward. No matcher changes until then: ``accept`` runs after the step's sampling."""
        self._join()
        grammars = self._grammars
        if not grammars:
            return None
        for seq_id in [i for i, (s, _) in grammars.items() if s.is_finished]:
            del grammars[seq_id]
        for child, parent in batch.forked:
            if parent.seq_id in grammars:
                grammars[child.seq_id] = (child, grammars[parent.seq_id][1].fork())
        sampling = [seq for seq, n in zip(batch.seqs, batch.num_new_tokens)
                    if seq.seq_id in grammars and seq.num_computed_tokens + n == seq.num_tokens and seq.beam_group is None]
        sampling += [child for child, _ in batch.forked if child.seq_id in grammars]
        if not sampling:
            return None
        bitmask = torch.empty(len(sampling), self.compiler.num_words, dtype=torch.int32)
        matchers = [(grammars[seq.seq_id][1].matcher, row) for row, seq in enumerate(sampling)]
        seq_ids = [seq.seq_id for seq in sampling]
        if not self.overlap:
            start = time.perf_counter()
            self._fill(sampling, matchers, bitmask)
            self.mask_wait_seconds += time.perf_counter() - start
            return GrammarBitmask(seq_ids, bitmask)
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedgen-mask")
        self._pending = GrammarBitmask(seq_ids, bitmask, _TimedFuture(self._thread.submit(self._fill, sampling, matchers, bitmask), self))
        return self._pending

    def _fill(self, sampling: list, matchers: list, bitmask: torch.Tensor) -> None:
        start = time.perf_counter()
        fill_bitmask_rows(matchers, bitmask, self.compiler.executor() if len(matchers) >= PARALLEL_ROWS else None)
        self._check_dead_ends(sampling, [m for m, _ in matchers], bitmask)
        self.mask_seconds += time.perf_counter() - start
        self.num_masks += len(sampling)

    def _check_dead_ends(self, sampling: list, matchers: list, bitmask: torch.Tensor) -> None:
        """A sequence whose grammar is in error, or can only stop while incomplete, gets the mask of
        EOS alone and a warning: it finishes in this step (finish_reason "stop", as vLLM's llguidance
        backend ends it; "error" with the reason when its request asks: ``accept``'s return), the
        others run on."""
        eos = self.compiler._vocabulary(frozenset(sampling[0].eos_token_ids)).eos_token_id
        # only rows that allow EOS can be dead ends (llguidance allows EOS alone there, and errors end in EOS too)
        suspects = ((bitmask[:, eos // 32] >> (eos % 32)) & 1).nonzero().flatten().tolist()
        for row in suspects:
            seq, matcher = sampling[row], matchers[row]
            if matcher.is_error() or (not matcher.is_accepting() and _only_eos(bitmask[row], eos)):
                bitmask[row] = 0
                bitmask[row, eos // 32] = _int32(1 << (eos % 32))
                text = self.compiler.tokenizer.decode(seq.output_token_ids)
                why = (f"llguidance failed on its {seq.sampling_params.structured_outputs.kind} constraint ({_message(matcher)})"
                       if matcher.is_error() else f"no token of the vocabulary continues its {seq.sampling_params.structured_outputs.kind} "
                       "constraint (it cannot be completed with this tokenizer)")
                self._dead[seq.seq_id] = f"{why} after {seq.num_output_tokens} generated tokens"
                logger.warning("request %r: %s after %d generated tokens (%r); the completion ends here, incomplete",
                               seq.request_id, why, seq.num_output_tokens, text[-60:])

    def accept(self, seqs: list, token_ids: list[int]) -> dict[int, str]:
        """Advance the matchers of the constrained ``seqs`` over their new tokens (before the
        engine appends them). Returns {seq id: why} of the sequences their grammar ends in this
        step (a dead end or a matcher in error: they sampled EOS, their only allowed token), for
        the engine to report (``LLMEngine``, a request's ``on_error``)."""
        self._join()
        grammars = self._grammars
        failed: dict[int, str] = {}
        if not grammars:
            return failed
        for seq, token in zip(seqs, token_ids):
            why = self._dead.pop(seq.seq_id, None)
            if why is not None:  # a dead end: it sampled EOS, its only allowed token, and ends
                failed[seq.seq_id] = why
                del grammars[seq.seq_id]
                continue
            entry = grammars.get(seq.seq_id)
            if entry is None or (token in seq.eos_token_ids and entry[1].is_terminated()):
                continue  # not constrained, or EOS after a grammar that ended by itself (NoExtension)
            entry[1].accept([token])  # refused (a parser limit such as max_items_in_row met mid-generation):
            # the matcher is in error, and the next mask (``_check_dead_ends``) ends the request with a warning
        return failed


class _TimedFuture:
    """A fill's future whose ``result`` adds the time the caller waited to ``manager.mask_wait_seconds``."""

    def __init__(self, future: concurrent.futures.Future, manager: StructuredOutputManager) -> None:
        self.future, self.manager = future, manager

    def result(self):
        start = time.perf_counter()
        try:
            return self.future.result()
        finally:
            self.manager.mask_wait_seconds += time.perf_counter() - start
