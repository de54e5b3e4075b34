"""Verification of draft tokens in one target pass (the model runner's side).

A verified sequence computes its last committed token and its k draft tokens, k + 1 query rows of
the varlen step, and gets logits at all of them. Row i is sampled by the ordinary sampler with the
sequence as it would be had drafts d_0..d_{i-1} been committed (a view with those token ids), so
penalties, min_tokens, logits processors, logprobs and the counter-based draw of position L + i are
exactly those of non-speculative decoding (a greedy request whose sampling reads no tokens, the
common case, is its own view: ``reads_tokens``). The sampled tokens are kept up to and including the
first row whose token differs from its draft (all k + 1 when every draft matches: the last is the
bonus token):

    rows        last  d_0  d_1  d_2                 sampled  t_0  t_1  t_2  t_3
    keep t_0; keep t_1 if t_0 == d_0; keep t_2 if also t_1 == d_1; ...

Since each kept token is the token the non-speculative engine would have drawn at that position
with that prefix (the draw is a function of seed, completion and position, not of a generator's
state), the output equals speculation off token for token, greedy and seeded alike. For an n-gram
draft (q one-hot) a draft is accepted with probability p(d), as in Leviathan et al.'s rule.
"""
from __future__ import annotations

import dataclasses


def view(seq, prefix: list[int]):
    """``seq`` as if ``prefix`` (accepted drafts) were committed: what the sampler reads of it."""
    return dataclasses.replace(seq, token_ids=seq.token_ids + prefix)


def reads_tokens(params) -> bool:
    """Whether sampling a row of a sequence with these ``SamplingParams`` reads the sequence's
    tokens: the position of a random draw (temperature > 0), the output count of ``min_tokens``,
    the tokens seen by penalties. A greedy row without them (logit bias, allowed ids and logprobs
    read only the logits) samples the same from the sequence as from any view of it."""
    return not params.greedy or bool(params.min_tokens) or params.has_penalties


def draft_rows(seq, draft: list[int], row_end: int):
    """The k + 1 logits rows of a verified sequence whose query rows end at ``row_end`` (its last
    committed token, then its k drafts) and what samples each: the sequence, then k views of it,
    or the sequence itself k + 1 times when its sampling reads no tokens (``reads_tokens``: a
    greedy request, the common case, builds no view)."""
    k = len(draft)
    rows = range(row_end - 1 - k, row_end)
    if seq.plain_greedy or not reads_tokens(seq.sampling_params):
        return rows, [seq] * (k + 1)
    return rows, [seq] + [view(seq, draft[:i]) for i in range(1, k + 1)]


def collapse(out, drafts: dict) -> None:
    """Fold a verified sequence's k + 1 sampled rows of ``out`` (a StepOutput) into its first token
    (kept in ``out.seqs``/``token_ids``/``logprobs``) and ``out.spec``: (sequence, the tokens kept
    after the first, their logprobs, its drafts)."""
    seqs, toks, lps = out.seqs, out.token_ids, out.logprobs
    keep_seqs, keep_toks, keep_lps = [], [], []
    i = 0
    while i < len(seqs):
        seq = seqs[i]
        keep_seqs.append(seq)
        keep_toks.append(toks[i])
        keep_lps.append(None if lps is None else lps[i])
        draft = drafts.get(seq.seq_id)
        if not draft:
            i += 1
            continue
        k = len(draft)
        rows = toks[i : i + k + 1]
        m = 0
        while m < k and rows[m] == draft[m]:
            m += 1
        out.spec.append((seq, rows[1 : m + 1], [None] * m if lps is None else lps[i + 1 : i + m + 1], draft))
        i += k + 1
    out.seqs, out.token_ids = keep_seqs, keep_toks
    if lps is not None:
        out.logprobs = keep_lps
