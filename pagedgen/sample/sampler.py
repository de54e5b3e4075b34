"""Turns the logits of the sequences that finish a step into their next tokens (and logprobs).

Order of work, as vLLM v1's sampler (vllm/v1/sample/sampler.py):
0. the grammar bitmask of structured outputs, on the constrained rows (structured_output/token_bitmask.py;
   vLLM applies it just before its sampler); a constrained row allowing few tokens that asks for
   no logprobs and no logits processing skips it and runs steps 4-5 over those tokens alone
   (``_sample_candidates``);
1. logprobs, if a row asks: of the raw logits, from one log-sum-exp per row once the token is
   chosen (no [rows, vocab] log-softmax; see sample/logprobs.py);
2. allowed_token_ids, logit bias and min_tokens (EOS / stop tokens banned while fewer than
   min_tokens are generated);
3. repetition, frequency and presence penalties;
4. greedy rows take the argmax here;
5. other rows: temperature, min-p, top-k, top-p (sample/logits_processors.py), then sampling by the
   inverse transform: one ``u ~ U[0, 1)`` per row, the token is the first whose cumulative
   probability exceeds ``u`` (``inverse_cdf_sample``). One random number per sampled token, where the
   exponential race ``argmax(probs / q)``, ``q ~ Exp(1)`` (vLLM's), needs one per vocabulary entry:
   over a 50k vocabulary on a CPU those draws cost more than the forward pass of a small model.

Randomness is a function, not a state: the ``u`` of the token at position ``p`` of completion ``j``
of a request with seed ``s`` is ``counter_uniform(s, j, p)``, a hash (splitmix64's finaliser,
three rounds) of the three numbers, so no generator object lives anywhere: a worker in another
process draws the same ``u`` from the step record alone, and a token drawn again after preemption
or a rolled-back step is the same token. A request without a seed uses the key of the engine's
seed (``LLM(seed=...)``) and its sequence id as the stream. Every step of the pipeline is row-wise:
a row's token does not depend on what else shares the batch, on the batch order, or on preemption.

Device: every step above is batched tensor work on the logits' device (a GPU's logits never
travel whole); the per-row parameters go down as a few small tensors, and the sampled ids and the
requested logprobs (packed by ``sample/logprobs.py::logprob_tensors`` into one float64 tensor) come
back in one copy, ``_to_host``. The draws are computed there too: ``counter_uniforms_torch`` is the
same hash in torch int64 arithmetic (wrapping + and *, shifts made logical), bit for bit the Python
reference; on the CPU the numpy version ``counter_uniforms`` is used (cheaper on small arrays).

Fast path: when every row is greedy and no row asks for logprobs, penalties, logit bias,
allowed_token_ids or min_tokens, a step is one argmax; deciding that reads one flag per sequence
(``Sequence.plain_greedy``, computed once when the sequence is made).
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import Callable, Optional
from typing import Sequence as Seq

import numpy as np
import torch

from pagedgen import ops
from pagedgen.core.sequence import Sequence
from pagedgen.outputs import Logprob
from pagedgen.sample import logits_processors as lp
from pagedgen.sample.logprobs import logprob_tensors, unpack_logprob_dicts
from pagedgen.sampling_params import as_int64
from pagedgen.structured_output import token_bitmask
from pagedgen.structured_output.token_bitmask import GrammarBitmask

_PLAIN_GREEDY = attrgetter("plain_greedy")
_CPU = torch.device("cpu")


_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment
_MUL1, _MUL2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's finaliser
_UNSEEDED = 0x5EED_0F_E4_61_4E_5EED  # keeps the keys of unseeded requests apart from request seeds


def _mix(z: int) -> int:
    z = (z + _GOLDEN) & _M64
    z = ((z ^ (z >> 30)) * _MUL1) & _M64
    z = ((z ^ (z >> 27)) * _MUL2) & _M64
    return z ^ (z >> 31)


def counter_uniform(key: int, stream: int, position: int) -> float:
    """The plain Python reference of ``counter_uniforms`` for one row: U[0, 1) with 53 bits from
    ``mix(mix(mix(key) ^ stream) ^ position)`` over unsigned 64-bit integers."""
    h = _mix(_mix(_mix(key & _M64) ^ (stream & _M64)) ^ (position & _M64))
    return (h >> 11) * 2.0**-53


def unseeded_key(engine_seed: int) -> int:
    """The draw key (int64) of the requests without a seed of an engine seeded with ``engine_seed``."""
    return as_int64(_mix((engine_seed & _M64) ^ _UNSEEDED))


_G_U64, _MUL1_U64, _MUL2_U64 = np.uint64(_GOLDEN), np.uint64(_MUL1), np.uint64(_MUL2)
_S11, _S27, _S30, _S31 = (np.uint64(k) for k in (11, 27, 30, 31))


def _mix_u64(z: np.ndarray) -> np.ndarray:  # [R] uint64; numpy's unsigned arithmetic wraps mod 2**64
    z = z + _G_U64
    z = (z ^ (z >> _S30)) * _MUL1_U64
    z = (z ^ (z >> _S27)) * _MUL2_U64
    return z ^ (z >> _S31)


def counter_uniforms(keys, streams, positions) -> torch.Tensor:
    """One U[0, 1) float64 draw per row, a pure function of (key, stream, position) (each R
    int64 values: lists or arrays): bit for bit ``counter_uniform`` of each row
    (tests/sample/test_sampling_draws.py). Returns [R] float64. In numpy, whose uint64 arithmetic wraps
    and whose ops on small arrays cost a fraction of torch's: a dozen ops whatever R."""
    k, s, p = (np.asarray(x, dtype=np.int64).view(np.uint64) for x in (keys, streams, positions))
    h = _mix_u64(_mix_u64(_mix_u64(k) ^ s) ^ p)  # [R] uint64
    return torch.from_numpy((h >> _S11).astype(np.float64) * 2.0**-53)


def _i64(value: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits (torch has no uint64 arithmetic)."""
    return value - (1 << 64) if value >= (1 << 63) else value


_G_I64, _MUL1_I64, _MUL2_I64 = _i64(_GOLDEN), _i64(_MUL1), _i64(_MUL2)


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits: torch's ``>>`` is arithmetic on int64, so the k copies of
    the sign bit it shifts in are masked off."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix_i64(z: torch.Tensor) -> torch.Tensor:  # [R] int64; + and * wrap mod 2**64 in two's complement
    z = z + _G_I64
    z = (z ^ _shr(z, 30)) * _MUL1_I64
    z = (z ^ _shr(z, 27)) * _MUL2_I64
    return z ^ _shr(z, 31)


def counter_uniforms_torch(keys: torch.Tensor, streams: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``counter_uniforms`` in torch int64 arithmetic on the tensors' device (a GPU worker draws
    without a host round trip): keys, streams, positions [R] int64 on one device -> [R] float64,
    bit for bit ``counter_uniform`` of each row (tests/sample/test_sampling_draws.py). Multiplication and
    addition of int64 wrap modulo 2**64 as unsigned arithmetic does; shifts are made logical."""
    h = _mix_i64(_mix_i64(_mix_i64(keys) ^ streams) ^ positions)  # [R] int64, the bits of the uint64 hash
    return _shr(h, 11).double() * 2.0**-53  # 53 bits: exact in float64


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim: [N, vocab] float32 / bfloat16 / float16 -> [N] int64, the ids of
    ``logits.max(dim=-1).indices`` and ``argmax`` (the first maximal index on ties, NaN counting as
    the maximum). Through ``ops.argmax``: on the CPU a vectorised kernel at about memory speed,
    several times faster than ``max(dim).indices`` (itself twice as fast as ``argmax``); rows with a
    strided last dim are made contiguous first."""
    if logits.stride(-1) != 1:  # the kernel reads rows as contiguous runs
        logits = logits.contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    ops.argmax(out, logits)
    return out


@dataclass
class SamplerOutput:
    """token_ids[i] is row i's new token; logprobs is None when no row asked, else per row a
    {token id: Logprob} (None for rows that did not ask)."""

    token_ids: list[int]
    logprobs: Optional[list[Optional[dict[int, Logprob]]]] = None


class Sampler:
    """Picks one token per row.

    Args:
        seed: the engine's seed, the key of the draws of requests without a seed of their own.
    """

    def __init__(self, seed: int) -> None:
        self.unseeded_key = unseeded_key(seed)

    def __call__(
        self,
        logits: torch.Tensor,
        seqs: Seq[Sequence],
        grammar_bitmask: Optional[GrammarBitmask] = None,
        resample: Optional[Callable[[torch.Tensor, torch.Tensor, list[int]], torch.Tensor]] = None,
    ) -> SamplerOutput:
        """logits: [num_seqs, vocab] on any device (float32 or the model's bf16/fp16), row i for
        seqs[i]. All the work runs on the logits' device; the sampled ids and the requested
        logprobs come back to the host in one copy (``_to_host``). The argmax of greedy rows
        without logits processing and the logprobs read the logits in their own dtype; the
        processing and the draw work in float32. ``grammar_bitmask``: the
        structured-output rows of this step (structured_output/manager.py), applied first, in place (vLLM's
        order: logprobs are then those of the masked logits); a constrained row whose grammar allows
        at most ``token_bitmask.MAX_CANDIDATES`` tokens and that asks for no logprobs and no logits
        processing is sampled among those tokens alone (``_sample_candidates``; vocabularies of
        ``token_bitmask.MIN_CANDIDATE_VOCAB`` tokens or more).
        ``resample(tokens, probs, rows)``: speculative decoding with a draft model
        (sample/rejection_sampler.py): given the drawn tokens [R] int64 of the sampled rows ``rows``
        (indices into ``seqs``) and the distributions they were drawn from, probs [R, vocab]
        float32, returns the tokens to keep instead (the rejection sampler's); logprobs are those
        of the returned tokens. (Steps with a grammar bitmask are not speculated.)"""
        sampled, logprobs = self._on_device(logits, seqs, grammar_bitmask, resample=resample)
        if logprobs is None:
            return SamplerOutput(_to_host(sampled).tolist())
        packed, lp_rows, num_logprobs = logprobs
        host = _to_host(torch.cat([sampled.double(), packed.view(-1)]))  # the step's one copy
        n = len(seqs)
        token_ids = host[:n].long().tolist()
        dicts = unpack_logprob_dicts(host[n:].view(len(lp_rows), -1), num_logprobs)
        out = [None] * n
        for i, d in zip(lp_rows, dicts):
            out[i] = d
        return SamplerOutput(token_ids, out)

    def _on_device(self, logits: torch.Tensor, seqs: Seq[Sequence], grammar_bitmask: Optional[GrammarBitmask], candidates: bool = True,
                   resample=None):
        """(sampled [num_seqs] int64 on the logits' device, None or (packed logprobs [L, 3 + 2k]
        float64, their rows, each row's number of logprobs))."""
        if grammar_bitmask is not None:
            found = None
            if candidates and logits.shape[1] >= token_bitmask.MIN_CANDIDATE_VOCAB:
                eligible = [s.sampling_params.logprobs is None and not s.sampling_params.changes_logits for s in seqs]
                found = grammar_bitmask.candidates(seqs, eligible, logits.shape[1])
            if found is not None:
                return self._sample_candidates(logits, seqs, grammar_bitmask, found)
            logits = grammar_bitmask.apply(logits, seqs)
        if all(map(_PLAIN_GREEDY, seqs)):  # the fast path: one argmax, one copy
            return greedy_ids(logits), None
        device = logits.device
        params = [s.sampling_params for s in seqs]
        kinds = {id(p): p for p in params}.values()
        all_greedy = all(p.greedy for p in kinds)
        want_logprobs = any(p.logprobs is not None for p in kinds)
        processed = any(p.changes_logits for p in kinds)

        raw = None
        if want_logprobs:  # the raw logits of the rows that ask: the processing below makes new tensors
            lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
            lp_index = None if len(lp_rows) == len(params) else _index(lp_rows, device)
            raw = logits if lp_index is None else logits[lp_index]  # [L, vocab], the logits' dtype (read as is)
        if processed or not all_greedy:  # greedy rows alone take the argmax in the logits' own dtype
            logits = logits.float()  # [num_seqs, vocab] float32 (no copy when it is already)
        if processed:
            logits = self._process(logits, seqs, params)
        sampled = self._sample(logits, seqs, params, all_greedy, resample)  # [num_seqs] int64, on the device
        if not want_logprobs:
            return sampled, None
        num_logprobs = [params[i].logprobs for i in lp_rows]
        chosen = sampled if lp_index is None else sampled[lp_index]
        return sampled, (logprob_tensors(raw, chosen, max(num_logprobs)), lp_rows, num_logprobs)  # log-sum-exp per row

    def _sample_candidates(self, logits: torch.Tensor, seqs: Seq[Sequence], grammar_bitmask: GrammarBitmask, found):
        """The rows of ``found`` (a ``token_bitmask.Candidates``) sampled among their allowed tokens
        alone: greedy, temperature, min-p, top-k, top-p and the draw (its ``u`` the same as the
        full row's) over [rows, width] candidate logits in vocabulary order instead of [rows, vocab]
        masked ones, one group per width (``Candidates.by_width``: a row's width is a function of
        its own count, so its bits do not depend on the rest of the step). The same token as the
        masked full row: the argmax is the first maximum in vocabulary order either way, and the
        draw sees the same probabilities (tokens outside the grammar have probability 0 in the full
        row), summed over fewer terms, so a draw within a rounding error of a boundary between two
        tokens may take the other. The other rows (a dense mask, logprobs or logits processing
        wanted, unconstrained) take the full path, and the parts are merged on the device before
        the step's one copy."""
        device = logits.device
        parts = []  # (batch rows, their tokens [len(rows)] int64)
        for width, part in found.by_width():
            values, ids = part.gather(logits, width)  # [n, width] float32, [n, width] int64
            picked_seqs = [seqs[i] for i in part.rows]
            params = [s.sampling_params for s in picked_seqs]
            columns = self._sample(values, picked_seqs, params, all(p.greedy for p in params))  # [n] int64 in [0, width)
            parts.append((part.rows, ids.gather(1, columns.unsqueeze(1)).squeeze(1)))  # [n] int64 token ids
        if len(parts) == 1 and len(found.rows) == len(seqs):
            return parts[0][1], None
        sampled = torch.empty(len(seqs), dtype=torch.int64, device=device)
        for rows, tokens in parts:
            sampled[_index(rows, device)] = tokens
        if len(found.rows) == len(seqs):
            return sampled, None
        taken = set(found.rows)
        rest = [i for i in range(len(seqs)) if i not in taken]
        rest_index = _index(rest, device)
        rest_sampled, logprobs = self._on_device(logits[rest_index], [seqs[i] for i in rest], grammar_bitmask, candidates=False)
        sampled[rest_index] = rest_sampled
        if logprobs is not None:
            packed, lp_rows, num_logprobs = logprobs
            logprobs = (packed, [rest[i] for i in lp_rows], num_logprobs)
        return sampled, logprobs

    @staticmethod
    def _process(logits: torch.Tensor, seqs: Seq[Sequence], params) -> torch.Tensor:
        """Allowed token ids, logit bias, min_tokens bans and penalties, for the rows that ask (steps 2-3),
        on the logits' device: the per-row lists are gathered on the host and moved once each."""
        vocab, device = logits.shape[1], logits.device
        bias_rows, bias_ids, bias_vals, ban_rows, ban_ids, pen_rows = [], [], [], [], [], []
        allow_rows, allow_ids = [], []
        for i, (seq, p) in enumerate(zip(seqs, params)):
            if p.allowed_token_ids:
                allow_rows.extend([i] * len(p.allowed_token_ids))
                allow_ids.extend(p.allowed_token_ids)
            if p.logit_bias:
                bias_rows.extend([i] * len(p.logit_bias))
                bias_ids.extend(p.logit_bias.keys())
                bias_vals.extend(p.logit_bias.values())
            if p.min_tokens and seq.num_output_tokens < p.min_tokens:
                banned = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | seq.eos_token_ids
                ban_rows.extend([i] * len(banned))
                ban_ids.extend(banned)
            if p.has_penalties:
                pen_rows.append(i)
        if allow_rows:
            logits = lp.apply_allowed_token_ids(logits, _index(allow_rows, device), _index(allow_ids, device))
        if bias_rows:
            logits = lp.apply_logit_bias(
                logits, _index(bias_rows, device), _index(bias_ids, device), torch.tensor(bias_vals, dtype=torch.float32, device=device)
            )
        if ban_rows:
            logits = lp.apply_token_ban(logits, _index(ban_rows, device), _index(ban_ids, device))
        if pen_rows:
            rows = _index(pen_rows, device)
            pen_seqs = [seqs[i] for i in pen_rows]
            pen_params = [params[i] for i in pen_rows]
            seen = lp.token_counts([s.token_ids for s in pen_seqs], vocab, device) > 0
            counts = lp.token_counts([s.output_token_ids for s in pen_seqs], vocab, device)
            knobs = torch.tensor(
                [[p.presence_penalty, p.frequency_penalty, p.repetition_penalty] for p in pen_params], dtype=torch.float32
            ).to(device)  # [P, 3]
            penalised = lp.apply_penalties(logits[rows], seen, counts, knobs[:, 0], knobs[:, 1], knobs[:, 2])
            logits = logits.index_copy(0, rows, penalised)
        return logits

    def _sample(self, logits: torch.Tensor, seqs: Seq[Sequence], params, all_greedy: bool, resample=None) -> torch.Tensor:
        """Steps 4-5: [num_seqs] int64 token ids on the logits' device. Greedy rows take the argmax
        and pay nothing for the sampled ones: temperature, filters, softmax and the draw run on the
        sampled rows only. ``resample``: see ``__call__``."""
        if all_greedy:
            return greedy_ids(logits)
        device = logits.device
        rows = [i for i, p in enumerate(params) if not p.greedy]
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        rows_t = _index(rows, device) if greedy_rows else None
        x = logits[rows_t] if greedy_rows else logits  # [R, vocab], the sampled rows
        probs = self._probs(x, [params[i] for i in rows])  # [R, vocab]
        tokens = inverse_cdf_sample(probs, self._uniforms([seqs[i] for i in rows], device))  # [R]
        if resample is not None:
            tokens = resample(tokens, probs, rows)
        if not greedy_rows:
            return tokens
        greedy_t = _index(greedy_rows, device)
        sampled = torch.empty(len(params), dtype=torch.int64, device=device)
        sampled[rows_t] = tokens
        sampled[greedy_t] = greedy_ids(logits[greedy_t])
        return sampled

    @staticmethod
    def _probs(x: torch.Tensor, sp: list) -> torch.Tensor:
        """The distributions sampled rows draw from: x [R, vocab] float32 processed logits, ``sp``
        their SamplingParams (none greedy) -> [R, vocab] float32 after temperature, min-p, top-k
        and top-p, softmaxed (step 5 before the draw)."""
        device = x.device
        knobs = torch.tensor([[p.temperature, p.min_p, p.top_p] for p in sp], dtype=torch.float32).to(device)  # [R, 3]
        x = x / knobs[:, 0:1]
        if any(p.min_p > 0.0 for p in sp):
            x = lp.apply_min_p(x, knobs[:, 1])
        filtered = [r for r, p in enumerate(sp) if p.top_k > 0 or p.top_p < 1.0]
        if filtered:  # top-k / top-p sort the vocabulary: only the rows that ask for it
            top_k = torch.tensor([sp[r].top_k for r in filtered], dtype=torch.int64).to(device)
            if len(filtered) == len(sp):
                x = lp.apply_top_k_top_p(x, top_k, knobs[:, 2])
            else:
                index = _index(filtered, device)
                x = x.index_copy(0, index, lp.apply_top_k_top_p(x[index], top_k, knobs[index, 2]))
        return x.softmax(dim=-1)  # [R, vocab]

    def propose(self, logits: torch.Tensor, seqs: Seq[Sequence], stream_tag: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A draft model's proposals (speculative decoding, spec_decode/draft_model.py): one token per row
        of ``logits`` [R, vocab] (the draft's, any float dtype), drawn as ``__call__`` would draw
        the target's (the same logit processing, penalties and min_tokens on ``seqs``, the same
        temperature, min-p, top-k and top-p) from draws on the stream ``stream ^ stream_tag``, so
        they never reuse the target's. Returns (tokens [R] int64, q): q is None when every row is
        greedy, else [R, vocab] float32, the distribution each token was drawn from (one-hot at the
        argmax for greedy rows); on the logits' device."""
        if all(map(_PLAIN_GREEDY, seqs)):  # the fast path: one argmax
            return greedy_ids(logits), None
        device = logits.device
        params = [s.sampling_params for s in seqs]
        x = logits.float()  # [R, vocab]
        if any(p.changes_logits for p in params):
            x = self._process(x, seqs, params)
        tokens = greedy_ids(x)  # [R] int64: the greedy rows' tokens
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if not rows:
            return tokens, None
        q = torch.zeros_like(x)  # [R, vocab]
        q[torch.arange(len(params), device=device), tokens] = 1.0
        rows_t = _index(rows, device)
        probs = self._probs(x[rows_t], [params[i] for i in rows])  # [S, vocab]
        tokens[rows_t] = inverse_cdf_sample(probs, self._uniforms([seqs[i] for i in rows], device, stream_tag))
        q[rows_t] = probs
        return tokens, q

    def draw_key(self, seq: Sequence) -> tuple[int, int]:
        """(key, stream) of a sequence's draws: its request's seed and its completion index, or the
        engine's key and its sequence id for a request without a seed."""
        return (self.unseeded_key, seq.seq_id) if seq.seed is None else (seq.seed, seq.index)

    def _uniforms(self, seqs: Seq[Sequence], device: torch.device = _CPU, stream_tag: int = 0) -> torch.Tensor:
        """One U[0, 1) float64 draw per row (see the module docstring), on ``device``: keyed by the
        request's seed and the completion index, or by the engine's key and the sequence id for a
        request without a seed; the position is that of the token being drawn. On the CPU through
        numpy (``counter_uniforms``, cheaper on small arrays), elsewhere in torch int64 arithmetic
        on the device (``counter_uniforms_torch``): the same bits either way."""
        unseeded = self.unseeded_key
        keys = [unseeded if s.seed is None else s.seed for s in seqs]
        streams = [s.seq_id if s.seed is None else s.index for s in seqs]
        if stream_tag:  # a draft model's draws (``propose``)
            streams = [as_int64(s ^ stream_tag) for s in streams]
        positions = [len(s.token_ids) for s in seqs]
        if device.type == "cpu":
            return counter_uniforms(keys, streams, positions)
        k, s, p = torch.tensor([keys, streams, positions], dtype=torch.int64).to(device)  # one copy: [3, R]
        return counter_uniforms_torch(k, s, p)


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    """A host list of ids as an int64 tensor on ``device`` (one host-to-device copy off the CPU)."""
    t = torch.tensor(values, dtype=torch.int64)
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """The one place where the sampler's results come back: a device tensor to the host (no copy on
    the CPU). tests/sample/test_sampler_device.py counts the calls."""
    return t if t.device.type == "cpu" else t.cpu()


def inverse_cdf_sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draw one token per row of ``probs`` [R, vocab] (rows summing to ~1) from ``u`` [R] float64 in
    [0, 1): the first token whose cumulative probability (float64, vocabulary order) exceeds
    ``u * total``. Returns [R] int64.

    Exact inverse-transform sampling, one uniform per draw (not one per vocabulary entry as the
    exponential race ``argmax(p / q)`` needs), and row-wise, so a row's token depends only on its own
    probabilities and draw. A token of probability 0 adds nothing to the cumulative sum and is never
    chosen: the threshold is kept strictly below the total, and the first cumulative value above it
    is one that grew.
    """
    cdf = probs.double().cumsum_(dim=-1)  # [R, vocab]
    total = cdf[:, -1]  # [R]
    x = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))  # [R], < total
    return torch.searchsorted(cdf, x.unsqueeze(1), right=True).squeeze(1)  # [R] int64
