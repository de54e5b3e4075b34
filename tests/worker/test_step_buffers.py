"""The persistent step buffers (worker/step_buffers.py): a step's inputs staged into one buffer,
moved in one copy, read back exactly; the buffers are reused from step to step."""
import torch

from pagedgen.worker.step_buffers import StepBuffers


def _step(n: int, width: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 32000, (3 * n,), generator=g),  # input ids [T] int64
        torch.arange(3 * n),  # positions [T] int64
        torch.randint(-1, 10**6, (3 * n,), generator=g),  # slots [T] int64
        torch.randint(0, 500, (n, width), generator=g, dtype=torch.int32),  # block tables [n, width] int32
        torch.randint(1, 4096, (n,), generator=g, dtype=torch.int32),  # seq lens [n] int32 (odd count: realigned after)
        torch.arange(n + 1, dtype=torch.int32),  # query_start_loc [n + 1]
        torch.randint(0, 3 * n + 1, (n,), generator=g),  # logits indices [n] int64
    ]


def test_on_the_cpu_the_tensors_pass_through_without_a_copy():
    step = _step(5, 3, 0)
    assert all(a is b for a, b in zip(StepBuffers(torch.device("cpu")).stage(step), step))


def test_staged_tensors_equal_the_inputs_and_live_in_one_reused_buffer():
    buffers = StepBuffers(torch.device("cpu"), stage_on_cpu=True)
    first_ptr = None
    for seed, (n, width) in enumerate([(7, 3), (5, 4), (1, 1), (7, 3), (0, 2)]):
        step = _step(n, width, seed)
        staged = buffers.stage(step)
        lo, hi = buffers.dev.data_ptr(), buffers.dev.data_ptr() + buffers.dev.numel()
        for got, want in zip(staged, step):
            assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
            if got.numel():
                assert lo <= got.data_ptr() < hi and got.data_ptr() % 8 == 0  # an aligned view of the one buffer
        first_ptr = first_ptr or buffers.dev.data_ptr()
        assert buffers.dev.data_ptr() == first_ptr  # steps no larger than the first reuse its buffer
