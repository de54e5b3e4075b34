"""Counter-based random draws: ``u = counter_uniform(key, stream, position)``, no generator state.

The tensor version is checked bit for bit against the plain Python reference (unsigned 64-bit
arithmetic), its output against U[0, 1), and the sampler's keys: a seeded row's draw depends only
on (seed, completion index, position), an unseeded row's on (engine seed, sequence id, position).
"""
import random

import pytest
import torch

from pagedgen.core.sequence import Sequence
from pagedgen.sample.sampler import Sampler, as_int64, counter_uniform, counter_uniforms, unseeded_key
from pagedgen.sampling_params import SamplingParams

EXTREMES = [0, 1, -1, 2**63 - 1, -(2**63), 12345, -98765]


def _ints(rng: random.Random, n: int) -> list[int]:
    return EXTREMES + [rng.randrange(-(2**63), 2**63) for _ in range(n - len(EXTREMES))]


def test_tensor_draws_equal_the_python_reference_bit_for_bit():
    rng = random.Random(0)
    keys, streams, positions = _ints(rng, 300), _ints(rng, 300), [rng.randrange(0, 1 << 20) for _ in range(300)]
    rng.shuffle(streams)
    got = counter_uniforms(torch.tensor(keys), torch.tensor(streams), torch.tensor(positions))
    assert got.dtype == torch.float64
    assert got.tolist() == [counter_uniform(k, s, p) for k, s, p in zip(keys, streams, positions)]


def test_draws_are_uniform_and_distinct():
    n = 200_000
    u = counter_uniforms(torch.full((n,), 7, dtype=torch.int64), torch.zeros(n, dtype=torch.int64), torch.arange(n))
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert u.unique().numel() == n
    counts = torch.histc(u, bins=20, min=0.0, max=1.0)
    chi2 = float(((counts - n / 20) ** 2 / (n / 20)).sum())
    assert chi2 < 43.8  # 19 degrees of freedom, p = 0.001
    lag = torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1]
    assert abs(float(lag)) < 0.01  # neighbouring positions are not correlated


def test_unsigned_and_signed_seeds_are_the_same_key():
    assert as_int64(2**64 - 1) == -1 and as_int64(2**63) == -(2**63) and as_int64(5) == 5
    assert unseeded_key(0) != unseeded_key(1)


def _seq(seq_id: int, params: SamplingParams, tokens: list[int], index: int = 0) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=str(seq_id), token_ids=list(tokens), num_prompt_tokens=2, sampling_params=params,
                    eos_token_ids=frozenset({2}), max_model_len=512, seed=None if params.seed is None else as_int64(params.seed), index=index)


def test_sampler_keys_rows_by_seed_index_and_position():
    """A seeded row's draw ignores the sequence id and the engine seed; it changes with the
    completion index and the position. An unseeded row's draw follows the engine seed and the
    sequence id."""
    sampler, other = Sampler(0), Sampler(99)
    seeded = SamplingParams(temperature=1.0, seed=2**64 - 3)
    draw = sampler._uniforms([_seq(4, seeded, [1, 5, 6])])
    assert torch.equal(draw, other._uniforms([_seq(77, seeded, [1, 5, 6])]))
    assert not torch.equal(draw, sampler._uniforms([_seq(4, seeded, [1, 5, 6], index=1)]))
    assert not torch.equal(draw, sampler._uniforms([_seq(4, seeded, [1, 5, 6, 7])]))
    assert float(draw) == counter_uniform(2**64 - 3, 0, 3)
    plain = SamplingParams(temperature=1.0)
    u = sampler._uniforms([_seq(4, plain, [1, 5]), _seq(5, plain, [1, 5])])
    assert u[0] != u[1] and float(u[0]) == counter_uniform(unseeded_key(0), 4, 2)
    assert not torch.equal(u, other._uniforms([_seq(4, plain, [1, 5]), _seq(5, plain, [1, 5])]))


@pytest.mark.parametrize("seed", [None, 3])
def test_engine_draws_do_not_depend_on_the_batch(llm, seed):
    """Through the engine: the sampled completion of a seeded request is the same alone and in a
    batch; so is an unseeded one's on two fresh engines given the same requests."""
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=12)
    prompts = ["Once upon a time", "The cat", "A big red ball"]
    if seed is not None:
        alone = llm.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0].token_ids
        batch = llm.generate(prompts[::-1], params, use_tqdm=False)[-1].outputs[0].token_ids
        assert alone == batch
    else:
        from pagedgen import LLM

        a = [o.outputs[0].token_ids for o in LLM(_stories(), seed=5).generate(prompts, params, use_tqdm=False)]
        b = [o.outputs[0].token_ids for o in LLM(_stories(), seed=5).generate(prompts, params, use_tqdm=False)]
        c = [o.outputs[0].token_ids for o in LLM(_stories(), seed=6).generate(prompts, params, use_tqdm=False)]
        assert a == b and a != c


def _stories() -> str:
    from conftest import STORIES

    return STORIES
