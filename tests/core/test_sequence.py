"""Sequence.append_token: vLLM's stop order (EOS, stop token ids, stop strings, then length) and min_tokens."""
import pytest

from pagedgen.core.sequence import Sequence
from pagedgen.sampling_params import SamplingParams

EOS = 2


def _seq(prompt_len=3, max_model_len=100, **params) -> Sequence:
    return Sequence(seq_id=0, request_id="0", token_ids=list(range(10, 10 + prompt_len)), num_prompt_tokens=prompt_len,
                    sampling_params=SamplingParams(**params), eos_token_ids=frozenset([EOS]), max_model_len=max_model_len)


def _run(seq: Sequence, tokens: list[int]) -> int:
    """Append tokens until one ends the sequence; the number appended."""
    for k, t in enumerate(tokens, 1):
        if seq.append_token(t):
            return k
    return 0


@pytest.mark.parametrize("params, tokens, stop_at, reason, stop_reason", [
    (dict(max_tokens=10), [5, EOS, 6], 2, "stop", None),
    (dict(max_tokens=10, ignore_eos=True), [5, EOS, 6], 0, None, None),
    (dict(max_tokens=10, stop_token_ids=[6]), [5, 6, EOS], 2, "stop", 6),
    (dict(max_tokens=10, stop_token_ids=[EOS]), [EOS], 1, "stop", None),  # EOS first: stop_reason None
    (dict(max_tokens=10, ignore_eos=True, stop_token_ids=[EOS]), [EOS], 1, "stop", EOS),
    (dict(max_tokens=10, min_tokens=3, stop_token_ids=[6]), [EOS, 6, 6, EOS], 3, "stop", 6),
    (dict(max_tokens=3), [5, 5, 5, 5], 3, "length", None),
    (dict(max_tokens=3, min_tokens=3), [5, 5, EOS], 3, "stop", None),  # EOS at min_tokens == max_tokens
    (dict(max_tokens=None), [5] * 10, 7, "length", None),  # max_model_len 10 with a 3-token prompt
])
def test_stop_order(params, tokens, stop_at, reason, stop_reason):
    seq = _seq(max_model_len=10, **params)
    assert _run(seq, tokens) == stop_at
    assert (seq.finish_reason, seq.stop_reason) == (reason, stop_reason)


def test_fork_keeps_the_stop_rules():
    parent = _seq(max_tokens=4, stop_token_ids=[6])
    parent.append_token(5)
    child = parent.fork(1, 1)
    assert _run(child, [5, 5, 5]) == 3 and child.finish_reason == "length"
    assert _run(_seq(max_tokens=4, stop_token_ids=[6]).fork(2, 1), [6]) == 1
