"""Sampling parameters of one request, with vLLM's names, order, defaults and meanings.

Source: vLLM ``vllm.SamplingParams`` (offline API, https://docs.vllm.ai/en/latest/api/vllm/sampling_params.html),
the OpenAI API reference for presence/frequency penalties and logit_bias, and Hugging Face
``GenerationConfig`` / ``RepetitionPenaltyLogitsProcessor`` for repetition_penalty.
See docs/sampling.md for how each field is applied.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Optional, Union

from pagedgen import _repr
from pagedgen.structured_output.params import StructuredOutputsParams, check_sampling_params

_GREEDY_EPS = 1e-5  # temperature below this means greedy, as in vLLM


def _check(cond: bool, field_name: str, allowed: str, value) -> None:
    if not cond:
        raise ValueError(f"SamplingParams.{field_name} must be {allowed}, got {value!r}")


def _is_int(x) -> bool:
    """An int, numpy's included (a value read from an array or a data frame); not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)



def as_int64(value: int) -> int:
    """A 64-bit integer (signed or unsigned, as ``SamplingParams.seed`` allows) as a signed int64:
    the form in which a seed keys the draws (``pagedgen/sample/sampler.py``)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= (1 << 63) else value

@dataclass
class SamplingParams:
    """How to sample the completions of one prompt.

    Attributes:
        n: completions to generate for the prompt (>= 1). Default 1.
        presence_penalty: subtracted once from the logit of every token that already appears in
            the completion (OpenAI semantics, output tokens only). Range [-2, 2]. Default 0.
        frequency_penalty: subtracted from a token's logit once per time it appears in the
            completion so far (OpenAI semantics, output tokens only). Range [-2, 2]. Default 0.
        repetition_penalty: Hugging Face / CTRL semantics over prompt and output tokens: the logit
            of a token already seen is divided by it when positive, multiplied when negative.
            Range (0, inf); 1.0 is off. Default 1.0.
        temperature: softmax temperature; 0 (below 1e-5) means greedy (argmax). Range [0, inf).
            Default 1.0.
        top_p: keep the smallest set of most likely tokens whose probability sums to at least top_p.
            Range (0, 1]. Default 1.0 (off).
        top_k: keep the k most likely tokens; 0 or -1 means all. Default 0 (off).
        min_p: drop tokens whose probability is below min_p times the most likely token's.
            Range [0, 1]. Default 0.0 (off).
        seed: the key of this request's random draws (each a hash of the seed, the completion index
            and the position: docs/sampling.md); the same seed gives the same completion whatever
            else shares the batch. None (or -1, as in vLLM): the engine's key (``LLM(seed=...)``)
            and the sequence id.
        stop: strings that end the completion when they appear in its text; the text is cut before
            the stop string (see ``include_stop_str_in_output``). A str or a list of non-empty str.
        stop_token_ids: token ids that end the completion (kept in ``token_ids``), besides EOS.
        ignore_eos: keep generating after the EOS token.
        max_tokens: most tokens to generate (>= 1), or None for up to ``max_model_len``. Default 16.
        min_tokens: EOS and ``stop_token_ids`` cannot be sampled, and stop strings do not match,
            before this many tokens are generated. Range [0, max_tokens]. Default 0.
        logprobs: None, or k >= 0: return, for each generated token, the log-probabilities of the
            k most likely tokens and of the sampled one (raw model distribution, see docs/sampling.md).
        prompt_logprobs: None, or k >= 0: the same for each prompt token (the first is None).
        prompt_logprob_start: None (the whole prompt, vLLM's default), or the position p >= 0 of
            the first prompt token whose logprobs are wanted (vLLM's ``prompt_logprob_start``,
            SGLang's ``logprob_start_len``): the entries before p are None (``prompt_logprobs``
            keeps one entry per prompt token), the positions before p - 1 may come from the
            prefix cache (a shared context computed once), and only the rows from p - 1 on are
            computed with logprobs; a p at or past the prompt's end leaves every entry None.
            Needs ``prompt_logprobs``.
        detokenize: produce ``text`` (and ``Logprob.decoded_token``); False leaves them empty.
        skip_special_tokens: drop special tokens from the text. Default True.
        spaces_between_special_tokens: passed to the tokenizer's decode (slow tokenizers put a
            space around special tokens). Default True.
        include_stop_str_in_output: keep the stop string (or the stop token's text) in ``text``.
        logit_bias: {token id: bias} added to the logits before sampling (OpenAI semantics).
            Bias range [-100, 100]; token ids >= 0 (and inside the vocabulary, checked by ``LLM``).
        allowed_token_ids: None, or a non-empty list of the only token ids that may be sampled (the
            others' logits become -inf before sampling; logprobs stay those of the raw model
            distribution). Token ids >= 0 (and inside the vocabulary, checked by ``LLM``).
        structured_outputs: None, or a ``StructuredOutputsParams``: a JSON schema, regex, choice
            or grammar every completion follows (docs/structured_outputs.md). Not with
            ignore_eos, min_tokens or allowed_token_ids (the grammar decides which tokens may
            come and where the completion may end).

    Raises:
        ValueError: a field outside its range (the message names the field and the range).
        TypeError: a field of the wrong type, or an unknown keyword.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    prompt_logprob_start: Optional[int] = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: Optional[dict[int, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    structured_outputs: Optional[StructuredOutputsParams] = None

    def __post_init__(self) -> None:
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if not _is_number(value):
                raise TypeError(f"SamplingParams.{name} must be a number, got {type(value).__name__}")
            setattr(self, name, float(value))
        for name in ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "prompt_logprob_start"):
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise TypeError(f"SamplingParams.{name} must be an int, got {type(value).__name__}")
            if value is not None:
                setattr(self, name, int(value))
        for name in ("n", "top_k", "min_tokens"):
            if getattr(self, name) is None:
                raise TypeError(f"SamplingParams.{name} must be an int, got None")
        for name in ("ignore_eos", "detokenize", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"SamplingParams.{name} must be a bool, got {type(getattr(self, name)).__name__}")

        _check(self.n >= 1, "n", "at least 1", self.n)
        for name in ("presence_penalty", "frequency_penalty"):
            _check(-2.0 <= getattr(self, name) <= 2.0, name, "in [-2, 2]", getattr(self, name))
        _check(0.0 < self.repetition_penalty < math.inf, "repetition_penalty", "in (0, inf)", self.repetition_penalty)
        _check(0.0 <= self.temperature < math.inf, "temperature", "in [0, inf)", self.temperature)
        _check(0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]", self.top_p)
        _check(self.top_k >= -1, "top_k", "-1, 0 (all tokens) or a positive int", self.top_k)
        if self.top_k == -1:
            self.top_k = 0
        _check(0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]", self.min_p)
        if self.seed == -1:  # as vLLM: -1 means no seed (the command line's way to say "random")
            self.seed = None
        if self.seed is not None:
            _check(-(2**63) <= self.seed < 2**64, "seed", "a 64-bit integer (-1: none)", self.seed)
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "at least 1 (or None)", self.max_tokens)
        _check(self.min_tokens >= 0, "min_tokens", "in [0, max_tokens]", self.min_tokens)
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", f"in [0, max_tokens={self.max_tokens}]", self.min_tokens)
        for name in ("logprobs", "prompt_logprobs", "prompt_logprob_start"):
            value = getattr(self, name)
            _check(value is None or value >= 0, name, "None or an int >= 0", value)
        if self.prompt_logprob_start is not None and self.prompt_logprobs is None:
            raise ValueError(f"SamplingParams.prompt_logprob_start={self.prompt_logprob_start} needs prompt_logprobs "
                             "(None or >= 0 top tokens per prompt token), got prompt_logprobs=None")

        self.stop = self._stop_list(self.stop)
        if self.stop and not self.detokenize:
            raise ValueError("SamplingParams.stop needs detokenize=True (stop strings are matched on the text)")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(_is_int(t) for t in self.stop_token_ids):
            raise TypeError("SamplingParams.stop_token_ids must be a list of int")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "non-negative token ids", self.stop_token_ids)
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise TypeError(f"SamplingParams.logit_bias must be a dict {{token id: bias}}, got {type(self.logit_bias).__name__}")
            for tok, bias in self.logit_bias.items():
                if not _is_int(tok) or not _is_number(bias):
                    raise TypeError(f"SamplingParams.logit_bias must map int token ids to numbers, got {tok!r}: {bias!r}")
                _check(tok >= 0, "logit_bias", "keyed by non-negative token ids", tok)
                _check(-100.0 <= bias <= 100.0, "logit_bias", "valued in [-100, 100]", bias)
            self.logit_bias = {int(tok): float(bias) for tok, bias in self.logit_bias.items()} or None
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not all(_is_int(t) for t in self.allowed_token_ids):
                raise TypeError("SamplingParams.allowed_token_ids must be a list of int (or None)")
            _check(len(self.allowed_token_ids) > 0, "allowed_token_ids", "None or a non-empty list of token ids", self.allowed_token_ids)
            _check(all(t >= 0 for t in self.allowed_token_ids), "allowed_token_ids", "non-negative token ids", self.allowed_token_ids)
            self.allowed_token_ids = [int(t) for t in self.allowed_token_ids]
        if self.structured_outputs is not None:
            check_sampling_params(self)

    @staticmethod
    def _stop_list(stop) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise TypeError("SamplingParams.stop must be a str or a list of str")
        _check(all(stop), "stop", "non-empty strings", list(stop))
        return list(stop)

    @property
    def greedy(self) -> bool:
        """True when this request takes the argmax token at every step."""
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        """True when presence, frequency or repetition penalties change the logits."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def changes_logits(self) -> bool:
        """True when penalties, logit bias, min_tokens or allowed_token_ids change the logits
        before sampling (the sampler's steps 2-3)."""
        return bool(self.has_penalties or self.logit_bias or self.min_tokens or self.allowed_token_ids)

    def clone(self, **changes) -> "SamplingParams":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def _fields(self) -> _repr.Fields:
        """temperature and max_tokens, then every field that differs from its default."""
        fields = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name not in ("temperature", "max_tokens") and (value == f.default or (f.default is None and value == [])):
                continue
            if f.name == "stop_token_ids":
                text = _repr.ids(value)
            elif f.name == "logit_bias" and len(value) > 8:
                text = "{" + ", ".join(f"{k}: {v}" for k, v in list(value.items())[:8]) + f", …}} ({len(value)} entries)"
            else:
                text = repr(value)
            fields.append((f.name, text))
        return fields

    def __repr__(self) -> str:
        """``SamplingParams(temperature=0.8, top_p=0.95, max_tokens=128)``: temperature, max_tokens
        and the fields set to something other than their default."""
        return _repr.render("SamplingParams", self._fields())

    def _repr_pretty_(self, p, cycle: bool) -> None:
        _repr.pretty(p, "SamplingParams", self._fields(), cycle)
