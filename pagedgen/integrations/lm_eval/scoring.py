"""lm_eval loglikelihood requests as pagedgen prompts, scored through prompt logprobs.

lm-evaluation-harness's ``hf`` backend, the reference here, feeds a causal model
``(context + continuation)[-(max_length + 1):][:-1]`` (at most ``max_length`` tokens) and reads the
continuation's log-probabilities from the logits of the last ``len(continuation)`` positions; a
continuation token counts as greedy when it is the argmax there. The same window here::

    window = (context + continuation)[-(max_length + 1):]      # left truncation
    prompt = window[:-1]                 # <= max_length = max_model_len tokens; a full one is allowed
    continuation[:-1]  = the last n - 1 prompt tokens -> prompt_logprobs=0 (each entry always holds
                                                         the prompt token itself, with its rank),
                                                         prompt_logprob_start = len(prompt) - (n - 1):
                                                         the context's full blocks come from the
                                                         prefix cache (computed once for the choices
                                                         that share it), only the continuation's
                                                         rows are computed with logprobs
    continuation[-1]   = the one token sampled after the prompt, forced by allowed_token_ids=[it];
                         logprobs=0 returns its raw log-probability and rank

Logprobs are the log-softmax of the raw logits (sample/logprobs.py), and a rank is the number of
tokens at least as likely, so "greedy" is rank 1 for every continuation token. The window takes
every position of ``max_model_len``, which is where vLLM refuses the prompt (lm-evaluation-harness
issue #2880): pagedgen accepts a prompt of exactly ``max_model_len`` tokens.
"""
from __future__ import annotations

from typing import Optional, Sequence as Seq

from pagedgen.outputs import RequestOutput
from pagedgen.sampling_params import SamplingParams


def scoring_prompt(index: int, context: Seq[int], continuation: Seq[int], max_length: int) -> list[int]:
    """The prompt that scores ``continuation`` after ``context`` (both token ids), left-truncated.

    Returns:
        ``(context + continuation)[-(max_length + 1):][:-1]``: 1 to ``max_length`` token ids.

    Raises:
        ValueError: an empty context or continuation, or a continuation longer than
            ``max_length`` tokens (naming request ``index``).
    """
    if not context:
        raise ValueError(f"loglikelihood request {index}: the context has no tokens (lm_eval gives empty contexts the prefix token)")
    if not continuation:
        raise ValueError(f"loglikelihood request {index}: the continuation has no tokens to score")
    if len(continuation) > max_length:
        raise ValueError(
            f"loglikelihood request {index}: the continuation has {len(continuation)} tokens, "
            f"more than max_length={max_length} (allowed: 1 to {max_length})"
        )
    return (list(context) + list(continuation))[-(max_length + 1):][:-1]


def scoring_params(prompts: Seq[Seq[int]], continuations: Seq[Seq[int]]) -> list[SamplingParams]:
    """One SamplingParams per request (``prompts[i]`` from ``scoring_prompt``): one greedy token
    forced to the continuation's last token, its logprob, and, when the continuation has n > 1
    tokens, the prompt logprobs of the prompt's last n - 1 tokens only (``prompt_logprob_start``),
    so that the context before them can come from the prefix cache. Requests with the same last
    token, kind and start share one object (``LLM.generate`` checks each distinct one once)."""
    cache: dict[tuple[int, Optional[int]], SamplingParams] = {}
    out = []
    for prompt, cont in zip(prompts, continuations):
        start = len(prompt) - (len(cont) - 1) if len(cont) > 1 else None
        key = (cont[-1], start)
        if key not in cache:
            cache[key] = SamplingParams(
                temperature=0.0,
                max_tokens=1,
                allowed_token_ids=[cont[-1]],
                logprobs=0,
                prompt_logprobs=None if start is None else 0,
                prompt_logprob_start=start,
                detokenize=False,
            )
        out.append(cache[key])
    return out


def continuation_score(output: RequestOutput, continuation: Seq[int]) -> tuple[float, bool]:
    """(sum of the continuation's log-probabilities, whether every token was the argmax) from the
    output of ``scoring_prompt``'s prompt run with ``scoring_params``.

    Raises:
        RuntimeError: the output lacks a continuation token's logprob (an engine bug, not bad input).
    """
    n = len(continuation)
    completion = output.outputs[0]
    if completion.token_ids[:1] != [continuation[-1]] or not completion.logprobs:
        raise RuntimeError(f"request {output.request_id}: the forced token {continuation[-1]} was not sampled")
    entries = list(output.prompt_logprobs[len(output.prompt_token_ids) - (n - 1):]) if n > 1 else []
    entries.append(completion.logprobs[0])
    total, greedy = 0.0, True
    for token, entry in zip(continuation, entries):
        lp = entry.get(token) if entry else None
        if lp is None:
            raise RuntimeError(f"request {output.request_id}: no logprob for continuation token {token}")
        total += lp.logprob
        greedy = greedy and lp.rank == 1
    return total, greedy
