"""What the tests of the two weight-only linear ops share (``int4_linear``: tests/ops/test_int4_linear.py,
``fp8_linear``: tests/ops/test_fp8_linear.py): one tile (csrc/cpu/linear_wonly.h) and one check of the
activations' side (csrc/op_checks.cpp), so one list of its bad calls and one batch-invariance check."""
import torch

#: (change, message): ``change(args)`` breaks a valid call's arguments (a dict with ``out`` [3, 20]
#: float32, ``x`` [3, 64] float32, ``bias`` [20] and the op's weights); the kernel raises ``message``.
ACTIVATION_BAD_CALLS = [
    (lambda a: a.update(x=a["x"].double()), "input must be float32, bfloat16 or float16"),
    (lambda a: a.update(out=a["out"].half()), "out must be Float"),
    (lambda a: a.update(bias=a["bias"][:5]), r"bias must be \[20\]"),
    (lambda a: a.update(x=a["x"].t().contiguous().t()), "input rows must be contiguous"),
    (lambda a: a.update(out=a["x"][:, :20]), "out must not overlap input"),
]


def assert_rows_independent(run, x: torch.Tensor) -> None:
    """``run(rows)`` -> out of those rows. A row alone (the kernel's in-register path), in tiles of any
    size at any start and in the whole batch of x (300 rows: the panel buffer's path), on one thread
    or all: the same bits."""
    full = run(x)
    alone = torch.cat([run(x[i:i + 1]) for i in range(0, x.shape[0], 7)])
    assert torch.equal(alone, full[0::7])
    for m in (2, 3, 4, 5, 8, 13, 64):
        for start in (0, 1, x.shape[0] // 2):
            assert torch.equal(run(x[start:start + m]), full[start:start + m])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(run(x), full)
    finally:
        torch.set_num_threads(threads)
