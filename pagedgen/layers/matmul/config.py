"""``MatmulConfig``: how the matmuls of one model run, and the row blocks that keep them batch-invariant.

**Batch invariance** (``MatmulConfig.row_blocks``). GEMM libraries pick their kernel by the
number of rows M, so the same row can get other bits in a batch of another size. MKL's sgemm
uses a gemv at M = 1, other kernels at M = 2-3 (and with 2 threads at 5-7 and 9-11) on the AVX2
AMD EPYC, and on a Xeon with AMX changes kernel from M = 58-1,024 when K > 1,024; oneDNN's
bf16 GEMM on AMX changes kernel at M = 33, and on AVX-512 BF16 without AMX runs one row alone
differently when K > 576; oneDNN's prepacked float32 GEMM runs one row alone differently for
some K. So in batch-invariant mode every GEMM runs in blocks whose sizes were measured to give
each row the same bits whatever the other rows and the row's position: MKL at least
``MIN_ROWS`` rows (zero rows added) and at most ``MAX_ROWS`` (``LONG_K_MAX_ROWS`` when K >
``LONG_K``), prepacked float32 at least ``PACKED_MIN_ROWS``, oneDNN bf16 at least
``BF16_MIN_ROWS`` and at most ``BF16_MAX_ROWS`` with AMX (``MAX_ROWS`` without), fp16 at least
``FP16_MIN_ROWS``. The tests check every row of batches of up to 1,100 rows against the row alone
at the model shapes, on the machine they run on (``tests/layers/test_batch_invariance_ops.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MatmulConfig:
    """How ``linear`` runs the matmuls of one model (the paths: ``choice``'s docstring; the row blocks: this module's).

    Attributes:
        weight_dtype: the dtype the weights are kept in; when it differs from the activations'
            dtype, ``linear`` converts the activations to it and the result back.
        min_rows: GEMMs of dense weights with fewer rows are padded with zero rows up to this many
            (0: never; > 0 is what makes the config batch-invariant).
        max_rows: GEMMs of more rows run in blocks of at most this many (0: never split).
        reason: why this path was chosen, for logs and docs.
        prepack_min_numel: weights of at least this many elements are prepacked for oneDNN by
            ``prepare_matmuls`` (0: none are).
        packed_min_rows, packed_max_rows: ``min_rows``/``max_rows`` for prepacked weights.
        long_k_max_rows: ``max_rows`` for dense weights of more than ``LONG_K`` input features
            (0: ``max_rows``).
        panels: every weight is packed into panels (``pack_panels``) for pagedgen's own GEMM
            (``ops.packed_linear``), which gives each row the same bits in any batch by itself.
        pairs: every weight (bf16) is packed into bf16 pairs (``pack_pairs``) for pagedgen's
            AVX512-BF16 GEMM (``ops.packed_linear_bf16``), batch-invariant by itself as well.
        amx: with ``pairs``, ``linear`` runs the pairs with pagedgen's AMX GEMM
            (``packed_linear_bf16_amx``; the default for bf16 on CPUs with AMX, ``choice``).
        int8_amx_min_rows: int8 W8A8 GEMMs (``int8_linear``) of at least this many rows run on
            AMX-INT8 tiles (``int8_linear_amx``, the same bits as the AVX2 tiles; ``int8_amx``), 0: never.
    """

    weight_dtype: torch.dtype
    min_rows: int = 0
    max_rows: int = 0
    reason: str = ""
    prepack_min_numel: int = 0
    packed_min_rows: int = 0
    packed_max_rows: int = 0
    long_k_max_rows: int = 0
    panels: bool = False
    pairs: bool = False
    amx: bool = False
    int8_amx_min_rows: int = 0

    @property
    def batch_invariant(self) -> bool:
        """True when a row's bits do not depend on the other rows of its GEMMs."""
        return self.min_rows > 0 or self.panels or self.pairs

    def row_blocks(self, weight: torch.Tensor) -> tuple[int, int]:
        """(min_rows, max_rows) for a GEMM with ``weight`` [out_features, in_features]."""
        if weight.is_mkldnn:
            return self.packed_min_rows, self.packed_max_rows
        if self.long_k_max_rows and weight.shape[1] > LONG_K:
            return self.min_rows, self.long_k_max_rows
        return self.min_rows, self.max_rows


#: the rows of every MKL GEMM in batch-invariant mode: at least MIN_ROWS (zero rows added), blocks of
#: at most MAX_ROWS. Measured on MKL sgemm (AVX2 AMD EPYC, 1 and 2 threads): M in {4, 8} and every
#: M >= 12 give each row the same bits, checked up to M = 1024 (benchmarks/matmul_choices.py --part bits);
#: larger M run as blocks of MAX_ROWS, so no GEMM leaves the checked range.
MIN_ROWS, MAX_ROWS = 16, 1024
#: MKL GEMMs of more than LONG_K input features run in blocks of at most LONG_K_MAX_ROWS rows: on a
#: Xeon with AMX (AVX-512, AMX-BF16; 2 threads) sgemm changes its kernel at M = 58 for K = 1,536,
#: at M = 300 for K = 2,048 and at M = 1,024 for K = 5,632 (row bits change), and kept every row's
#: bits for M in [16, 57] at each; K <= 1,024 kept them up to M = 1,100.
LONG_K, LONG_K_MAX_ROWS = 1024, 32
#: prepacked float32 weights (oneDNN) in batch-invariant mode: at least 2 rows (one row alone runs a
#: gemv with other bits for some K on the Xeon, e.g. K = 1,536), blocks of at most MAX_ROWS.
PACKED_MIN_ROWS = 2
#: oneDNN's bf16 GEMM (dense or prepacked) in batch-invariant mode: at least BF16_MIN_ROWS rows, blocks
#: of at most BF16_MAX_ROWS on a CPU with AMX, else MAX_ROWS (``bf16_row_blocks``). On the AMD EPYC with
#: AVX-512 BF16 and no AMX (Zen 4), one row alone gets other bits for some outputs when K > 576
#: (K = 1,536, 2,048, 5,632) and every M from 2 to 1,100 agrees at every position (1 and 2 threads,
#: random-135m and random-1b shapes); on the Xeon with AMX every M from 1 to 32 agrees and some rows
#: change from M = 33 (another kernel).
BF16_MIN_ROWS, BF16_MAX_ROWS = 2, 32
#: torch's fp16 GEMM on a CPU with oneDNN fp16, in batch-invariant mode: at least this many rows
#: (on the Xeon one row alone takes another kernel; M from 2 to 300 kept every row's bits), blocks
#: of at most MAX_ROWS.
FP16_MIN_ROWS = 2
