"""worker/pooler.py without a model: the rows each pooling sequence needs per step, its chunks
joined across steps, a restart at position 0 (recompute after preemption) and the poolers' math."""
from __future__ import annotations

import pytest
import torch

from pagedgen.core.sequence import Sequence
from pagedgen.pooling_params import PoolingSpec
from pagedgen.sampling_params import SamplingParams
from pagedgen.worker.pooler import PoolingRunner, finish


def _seq(seq_id: int, n: int, spec: PoolingSpec) -> Sequence:
    seq = Sequence(seq_id, str(seq_id), list(range(1, n + 1)), n, SamplingParams(max_tokens=1), frozenset(), 64)
    seq.pooling = spec
    return seq


MEAN = PoolingSpec("embed", "MEAN", False, None, False)
LAST = PoolingSpec("embed", "LAST", False, None, False)


def test_rows_chunks_and_restart():
    runner = PoolingRunner()
    mean, last = _seq(1, 5, MEAN), _seq(2, 4, LAST)
    hidden = torch.arange(40.0).view(10, 4)  # the prompts' rows: mean's 0..4, last's 5..8
    # step 1: mean computes positions 0..2 (rows 0-2), last all 4 (rows 3-6)
    rows, items = runner.rows([mean, last], [0, 0], [3, 4], [0, 3, 7])
    assert rows == [0, 1, 2, 6]
    out = runner.outputs(items, hidden[[0, 1, 2, 8]], head=None)
    assert [s.seq_id for s, _ in out] == [2] and torch.equal(out[0][1], hidden[8])
    # a recompute restarts mean at 0: its earlier rows are dropped
    rows, items = runner.rows([mean], [0], [2], [0, 2])
    runner.outputs(items, hidden[[0, 1]], head=None)
    rows, items = runner.rows([mean], [2], [5], [0, 3])
    (seq, data), = runner.outputs(items, hidden[[2, 3, 4]], head=None)
    assert torch.equal(data, hidden[:5].mean(dim=0))
    # a sequence resumed without its earlier rows (forgotten) is an error, not a wrong vector
    runner.rows([mean], [0], [2], [0, 2])
    runner.outputs(runner.rows([mean], [0], [2], [0, 2])[1], hidden[[0, 1]], head=None)
    runner.forget([1])
    with pytest.raises(RuntimeError, match="without its earlier rows"):
        runner.outputs(runner.rows([mean], [2], [5], [0, 3])[1], hidden[[2, 3, 4]], head=None)


def test_finish_poolers_head_and_dimensions():
    rows = torch.tensor([[3.0, 4.0, 0.0], [0.0, 0.0, 2.0], [1.0, 1.0, 1.0]])
    ids = [7, 9, 7]
    assert torch.equal(finish(PoolingSpec("embed", "CLS", False, None, True), rows, ids, None), torch.tensor([0.6, 0.8, 0.0]))
    assert torch.equal(finish(PoolingSpec("embed", "LAST", False, None, False, 2), rows[-1:], ids, None), torch.tensor([1.0, 1.0]))
    head = lambda x: x[:, :2] * 2  # noqa: E731 - a stand-in for the score layer: [m, 3] -> [m, 2]
    step = finish(PoolingSpec("token_classify", "STEP", True, None, False, None, 7, (1,)), rows, ids, head)
    assert torch.equal(step, torch.tensor([[8.0], [2.0]]))  # the rows of token 7, column 1
    probs = finish(PoolingSpec("classify", "MEAN", True, "softmax", False), rows, ids, head)
    assert torch.allclose(probs, (rows.mean(0, keepdim=True)[:, :2] * 2).softmax(-1)[0])
