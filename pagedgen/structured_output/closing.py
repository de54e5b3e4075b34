"""Closing JSON before the token limit (issue 51; ``StructuredOutputsParams.close_at_max_tokens``).

A small model at temperature 1 may write a free string (a string without ``maxLength``, a key of an
object that admits keys of its own) until ``max_tokens`` cuts it, and the text is then not JSON.
So a JSON request whose remaining tokens come near what the shortest way to close its JSON needs
is *steered to close*: from then on, at each sampled step, its mask (the grammar's, unchanged) is
narrowed to the first of these classes of tokens it allows, the model choosing within the class:

    the text ends inside a string          outside
    0  EOS (the JSON is complete)          0  EOS
    1  ``"`` then ``}`` / ``]``            1  ``}`` / ``]`` runs: close containers
    2  ``"`` (then ``,`` / ``:``)          2  ``"`` runs: an empty string (a value, or a key)
    3  digits (a string with minLength)    3  ``,`` / ``:`` (a ``"`` after): the next key, a value
                                           4  digits, ``-``: the shortest number
                                           5  ``{`` ``[`` ``t`` ``f`` ``n`` true false null

and to the grammar's whole mask where it allows none of them (the letters of a key among several;
jump-forward then writes the rest). Inside a string ``}`` and ``]`` are text, hence the two
columns (``text_state``: JSON strings are the only place a ``"`` or a backslash occurs). Every token
so chosen is one the grammar allows, so the completion stays valid; whitespace is in no class.

When to start (``StructuredOutputManager._steer_closing``): at a sampled step with ``remaining``
tokens left (``max_tokens``, else ``max_model_len``), ``estimate`` walks a copy of the matcher the
same way, one-byte tokens in class order (forced stretches as llguidance tokenizes them), until
the grammar accepts: that many tokens close the JSON (the model's choices inside a class are never
longer in bytes). The request closes from the first such step where ``remaining <= estimate +
MARGIN`` (room for EOS and slack); until then the next estimate waits half the slack, so a request
far from its limit is estimated a few times, not every step. Where the walk needs more than
``remaining + MARGIN`` tokens (a ``max_tokens`` below the shortest JSON of the schema: the model's
longer tokens could not close it in time either), the request is left alone for good: steering
could not make it valid and would only empty its strings; a request whose ``max_tokens`` is that
short from the start (the walk from the start state, once per constraint) is never estimated. Decisions are taken only at states
that force no bytes, the states where a step samples with jump-forward decoding on; with it off the
forced states between them are skipped, so the same requests close at the same tokens either way.
"""
from __future__ import annotations

import re
from typing import Optional

import numpy as np

MAX_WALK = 4096  #: the longest closing walk from a start state (``GrammarCompiler``, once per constraint)
MARGIN = 8  #: tokens kept free beyond the estimate: EOS, and what the model may open before the next estimate (a key, ":", an empty value)
_IN_STRING = (re.compile(rb'"[}\]]+'), re.compile(rb'"(?:[,:]+"?)?'), re.compile(rb"[0-9]+"))
_OUTSIDE = (re.compile(rb"[}\]]+"), re.compile(rb'"+'), re.compile(rb'[,:]+"?'), re.compile(rb"-?[0-9]+"),
            re.compile(rb"[{\[]|t|f|n|true|false|null"))
_PROBES_IN = (b'"', b"0", b"a")  # estimate's one-byte tokens, in class order
_PROBES_OUT = (b"}", b"]", b'"', b",", b":", b"1", b"2", b"3", b"4", b"5", b"6", b"7", b"8", b"9", b"0", b"-",
               b"{", b"[", b"t", b"f", b"n")  # "0" after the other digits: "-0" and "0.0" end no negative number
_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*(")?', re.S)  # a JSON string, its closing quote if there is one


class ClosingTables:
    """One vocabulary's classes as bitmask rows, EOS first: ``inside`` [1 + 3, W] and ``outside``
    [1 + 5, W] uint32; and the one-byte tokens ``estimate`` tries, in class order."""

    def __init__(self, tokens: list[bytes], eos_token_ids, num_words: int) -> None:
        eos = [t for t in eos_token_ids if t < len(tokens)]
        self.tokens = tokens
        self.inside = _masks(tokens, eos, _IN_STRING, num_words)
        self.outside = _masks(tokens, eos, _OUTSIDE, num_words)
        lowest: dict[bytes, int] = {}
        for i, t in enumerate(tokens):
            lowest.setdefault(t, i)
        self.probes_in = [lowest[b] for b in _PROBES_IN if b in lowest]
        self.probes_out = [lowest[b] for b in _PROBES_OUT if b in lowest]


def _masks(tokens: list[bytes], eos: list[int], patterns, num_words: int) -> np.ndarray:
    masks = np.zeros((1 + len(patterns), num_words), dtype=np.uint32)
    for c, ids in enumerate([eos] + [[i for i, t in enumerate(tokens) if t[:1] != b"\xff" and p.fullmatch(t)] for p in patterns]):
        for i in ids:
            masks[c, i // 32] |= np.uint32(1 << (i % 32))
    return masks


def text_state(text: bytes) -> tuple[bool, bool]:
    """(inside a string, after a backslash inside it) at the end of the JSON text ``text``."""
    last = None
    for last in _STRINGS.finditer(text):
        pass
    if last is None or last.group(1) is not None:
        return False, False
    return True, last.end() < len(text)  # the match stops before a lone trailing backslash


def _advance(inside: bool, escaped: bool, data: bytes) -> tuple[bool, bool]:
    for c in data:
        if escaped:
            escaped = False
        elif inside and c == 0x5C:  # backslash
            escaped = True
        elif c == 0x22:  # quote
            inside = not inside
    return inside, escaped


def estimate(matcher, tables: ClosingTables, state: tuple[bool, bool], limit: int) -> Optional[int]:
    """The tokens a closing walk takes from ``matcher``'s state (on a copy; ``state``: the text's
    ``text_state``) until the grammar accepts, or None when it takes more than ``limit``."""
    m, n, (inside, escaped), tokens = matcher.deep_copy(), 0, state, tables.tokens
    while n <= limit:
        if m.is_accepting():
            return n
        if m.is_stopped() or m.is_error():
            return None
        forced = m.compute_ff_tokens()
        if not forced:
            probes = tables.probes_in if inside and not escaped else tables.probes_out if not inside else ()
            forced = next(([t] for t in probes if m.validate_tokens([t]) == 1), None) or _lowest_allowed(m, tables)
            if not forced:
                return None
        if not m.consume_tokens(forced):
            return None
        n += len(forced)
        for t in forced:
            inside, escaped = _advance(inside, escaped, tokens[t])
    return None


def _lowest_allowed(matcher, tables: ClosingTables) -> list[int]:
    """The lowest token the grammar allows that is not EOS (a key's letter), as a one-token list."""
    words = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32).copy()
    words[: tables.outside.shape[1]] &= ~tables.outside[0]  # not EOS
    nonzero = np.flatnonzero(words)
    if not nonzero.size:
        return []
    w = int(nonzero[0])
    return [32 * w + (int(words[w]) & -int(words[w])).bit_length() - 1]


def steer(words: np.ndarray, inside: np.ndarray, tables: ClosingTables) -> None:
    """In place: each row of ``words`` [n, W] uint32 (the grammar's masks of closing rows; row i's
    text ends inside a string where ``inside[i]``) narrowed to the first class it allows tokens
    of; a row allowing none keeps its mask."""
    for rows, masks in ((np.flatnonzero(inside), tables.inside), (np.flatnonzero(~inside), tables.outside)):
        if not rows.size:
            continue
        inter = words[rows][:, None, :] & masks[None]  # [n, classes, W]
        some = inter.any(axis=2)  # [n, classes]
        hit = np.flatnonzero(some.any(axis=1))
        if hit.size:
            words[rows[hit]] = inter[hit, some[hit].argmax(axis=1)]
