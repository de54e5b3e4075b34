"""``linear``: the single point through which every matmul of every model runs, and how it runs.

- ``dispatch``: ``linear`` itself: pagedgen's kernel for a weight packed in panels or pairs, else the
  GEMM library in the row blocks of the model's ``MatmulConfig``; ``int8_linear``, the W8A8 GEMM of
  int8 weights (``pagedgen.layers.quant``); ``fp8_linear``, FP8 W8A16 (``pagedgen.layers.quant_fp8``); ``int4_linear``, int4 W4A16
  (``pagedgen.layers.quant_int4``).
- ``config``: ``MatmulConfig``, how one model's matmuls run, and the row blocks measured to keep a
  row's bits whatever the batch (batch invariance).
- ``choice``: ``choose_matmul``, the one place a model's path is chosen: what this CPU and build
  offer, ``PAGEDGEN_CPU_MATMUL``; its docstring describes every path and its measurements.
- ``packing``: the weight layouts (``pack_panels``, ``pack_pairs``, ``pack_int8``, oneDNN's ``prepack``) and
  ``prepare_matmuls``, which puts a loaded model's weights in the chosen one.
- ``amx_check``: ``amx_self_check``, which pagedgen's AMX GEMM (the default for bf16 models on CPUs with AMX) passes before a model uses it.
- ``int8_amx``: ``int8_amx_min_rows``, from how many rows int8 GEMMs run on AMX-INT8 tiles here (after
  ``int8_amx_self_check``, bitwise against the AVX2 tiles).

Every public name is imported from here (``pagedgen.layers.matmul.X``). A function or a flag read by
another function is replaced (in tests) in the module that reads it, e.g. ``matmul.choice.cpu_has_amx``
or ``matmul.amx_check._AMX_CHECKED``: replacing the name here changes nothing there.
"""
from pagedgen.layers.matmul.amx_check import AmxUnavailableError, amx_self_check
from pagedgen.layers.matmul.choice import (MATMUL_BACKENDS, PREPACK_MIN_NUMEL, PREPACK_MIN_NUMEL_BF16, amx_available,
                                           bf16_pairs_available, bf16_row_blocks, choose_matmul, cpu_has_amx,
                                           cpu_has_flag, cpu_matmul_backend, native_reduced_precision,
                                           onednn_prepack_available, onednn_prepack_supported)
from pagedgen.layers.matmul.config import (BF16_MAX_ROWS, BF16_MIN_ROWS, FP16_MIN_ROWS, LONG_K, LONG_K_MAX_ROWS,
                                           MAX_ROWS, MIN_ROWS, PACKED_MIN_ROWS, MatmulConfig)
from pagedgen.layers.matmul.dispatch import fp8_linear, int4_linear, int8_linear, linear
from pagedgen.layers.matmul.int8_amx import (INT8_AMX_MIN_ROWS, INT8_PATHS, cpu_has_amx_int8, int8_amx_min_rows,
                                             int8_amx_self_check)
from pagedgen.layers.matmul.packing import (PACKABLE_DTYPES, PANEL, PREPACK_ROWS, pack_int8, pack_pairs, pack_panels, prepack,
                                            prepare_matmuls)

__all__ = [
    "AmxUnavailableError", "amx_self_check",
    "MATMUL_BACKENDS", "PREPACK_MIN_NUMEL", "PREPACK_MIN_NUMEL_BF16", "amx_available", "bf16_pairs_available",
    "bf16_row_blocks", "choose_matmul", "cpu_has_amx", "cpu_has_flag", "cpu_matmul_backend", "native_reduced_precision",
    "onednn_prepack_available", "onednn_prepack_supported",
    "BF16_MAX_ROWS", "BF16_MIN_ROWS", "FP16_MIN_ROWS", "LONG_K", "LONG_K_MAX_ROWS", "MAX_ROWS", "MIN_ROWS",
    "PACKED_MIN_ROWS", "MatmulConfig",
    "fp8_linear", "int4_linear", "int8_linear", "linear",
    "INT8_AMX_MIN_ROWS", "INT8_PATHS", "cpu_has_amx_int8", "int8_amx_min_rows", "int8_amx_self_check",
    "PACKABLE_DTYPES", "PANEL", "PREPACK_ROWS", "pack_int8", "pack_pairs", "pack_panels", "prepack", "prepare_matmuls",
]
