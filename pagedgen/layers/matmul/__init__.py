"""How every matmul of a model runs (``linear``), and how that is chosen; see ``choice``.

Its names are imported from here (``pagedgen.layers.matmul.X``).
"""
from pagedgen.layers.matmul.choice import (BF16_MAX_ROWS, BF16_MIN_ROWS, FP16_MIN_ROWS, LONG_K, LONG_K_MAX_ROWS,
                                           MATMUL_BACKENDS, MAX_ROWS, MIN_ROWS, PACKABLE_DTYPES, PACKED_MIN_ROWS,
                                           PANEL, PREPACK_MIN_NUMEL, PREPACK_MIN_NUMEL_BF16, PREPACK_ROWS,
                                           AmxUnavailableError, MatmulConfig, amx_available, amx_self_check,
                                           bf16_pairs_available, bf16_row_blocks, choose_matmul, cpu_has_amx,
                                           cpu_has_flag, cpu_matmul_backend, linear, native_reduced_precision,
                                           onednn_prepack_available, onednn_prepack_supported, pack_pairs,
                                           pack_panels, prepack, prepare_matmuls)
