"""Which build of the CPU kernels this process runs.

setup.py compiles the CPU kernels (csrc/cpu/*.cpp) once per instruction-set level into the modules
``pagedgen._C_cpu_<level>``; the baseline module ``pagedgen._C`` (the op schemas, the CUDA kernels) is
compiled for any CPU and says which levels this CPU and its OS run (``cpu_supported_isa``: cpuid and
XCR0, csrc/cpu_features.cpp). ``load()`` imports exactly one level's module, the highest one that is
both built and supported, so one wheel runs on every x86-64 CPU with AVX2 at its own level's speed
(the design of PyTorch's ATen CPU kernels and oneDNN: compiled per ISA, chosen at run time).

Levels, lowest first (setup.py's ``CPU_LEVELS``):

==============  ===============================================================================
``avx2``        x86-64-v3: AVX2, FMA, F16C (8 float lanes; bf16 products emulated)
``avx512_bf16`` x86-64-v4 + AVX512-BF16 + AVX512-VNNI (16 float lanes, vdpbf16ps); e.g. AMD Zen 4
``amx``         avx512_bf16 + AMX-TILE/BF16/INT8 (the AMX GEMM); Intel Sapphire Rapids and later
==============  ===============================================================================

plus ``native`` (a build with ``PAGEDGEN_CPU_LEVELS=native``: -march=native, for the machine that built
it; used only when asked for) and ``generic`` (the compiler's default, the only level built on other
architectures).

``PAGEDGEN_CPU_ISA`` (read once, at import): ``auto`` (default), a level name (the highest level to use:
``avx2`` on a CPU with AMX runs the AVX2 kernels; ``native`` and ``generic`` are used as they are, when
built), or ``none`` (no CPU kernels: the PyTorch reference ops). Levels differ in the last bits of
their sums (vector width), each batch-invariant on its own.
"""
from __future__ import annotations

import importlib
import importlib.util
import os

import torch

#: The levels of a wheel on x86-64, lowest first (setup.py's CPU_LEVELS).
LEVELS = ("avx2", "avx512_bf16", "amx")
#: Levels built only on request (native) or on other architectures (generic).
OTHER_LEVELS = ("native", "generic")
ENV = "PAGEDGEN_CPU_ISA"
CHOICES = ("auto", "none") + LEVELS + OTHER_LEVELS


def module_name(level: str) -> str:
    """The module of ``level``'s CPU kernels, e.g. "pagedgen._C_cpu_avx2"."""
    return f"pagedgen._C_cpu_{level}"


def built_levels() -> tuple:
    """The levels whose module is built (installed next to pagedgen._C), in ``LEVELS + OTHER_LEVELS``
    order."""
    return tuple(lv for lv in LEVELS + OTHER_LEVELS if importlib.util.find_spec(module_name(lv)) is not None)


def supported_levels() -> tuple:
    """The levels of ``LEVELS`` this CPU and its OS run, lowest first (needs pagedgen._C loaded)."""
    return tuple(torch.ops.pagedgen.cpu_supported_isa())


def check_request(value: str | None) -> str:
    """``value`` of ``PAGEDGEN_CPU_ISA`` normalised ("auto" when unset or empty); ValueError naming the
    allowed values otherwise."""
    text = (value or "auto").strip().lower()
    if text not in CHOICES:
        raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(CHOICES)} (the highest CPU kernel level "
                         f"to use; see pagedgen/ops/isa.py)")
    return text


def choose(request: str, supported: tuple, built: tuple) -> tuple:
    """(level or None, why none) for a checked ``request`` (``check_request``), the levels this CPU runs
    and the levels built: the highest level of ``LEVELS`` that is built, supported and not above the
    request; ``native``/``generic`` when asked for and built; ``generic`` under "auto" when it is the
    only build (other architectures)."""
    if request == "none":
        return None, f"{ENV}=none: the CPU kernels are not loaded"
    if request in OTHER_LEVELS:
        if request in built:
            return request, ""
        return None, f"{ENV}={request}: pagedgen was built without that level (built: {', '.join(built) or 'none'})"
    cap = len(LEVELS) if request == "auto" else LEVELS.index(request) + 1
    usable = [lv for lv in LEVELS[:cap] if lv in supported and lv in built]
    if usable:
        return usable[-1], ""
    if request == "auto" and "generic" in built:
        return "generic", ""
    return None, (f"no CPU kernel level both built and run by this CPU{'' if request == 'auto' else ' up to ' + request} "
                  f"(built: {', '.join(built) or 'none'}; this CPU and OS run: {', '.join(supported) or 'none'}"
                  f"{'; AVX2 and FMA are the least a wheel needs' if not supported else ''})")


_loaded: str | None = None
_why_not = "pagedgen._C is not loaded"


def load() -> None:
    """Import the chosen level's module (once; registers the CPU kernels of torch.ops.pagedgen.*).
    Called by pagedgen.ops after pagedgen._C; where nothing loads, ``why_not()`` says why and the ops run
    their PyTorch reference."""
    global _loaded, _why_not
    if _loaded is not None:
        return
    try:
        request = check_request(os.environ.get(ENV))
    except ValueError as exc:
        _why_not = str(exc)
        return
    try:
        supported = supported_levels()
    except (AttributeError, RuntimeError) as exc:  # a pagedgen._C built before this check existed
        _why_not = f"pagedgen._C is older than its sources ({exc}); rebuild it with scripts/setup.sh"
        return
    level, why = choose(request, supported, built_levels())
    if level is None:
        _why_not = why
        return
    try:
        importlib.import_module(module_name(level))
    except ImportError as exc:
        _why_not = f"{module_name(level)} could not be imported ({exc})"
        return
    _loaded, _why_not = level, ""


def loaded() -> str | None:
    """The level of the CPU kernels loaded in this process, or None."""
    return _loaded


def why_not() -> str:
    """Why no CPU kernels are loaded (empty when they are)."""
    return _why_not


def loaded_features() -> frozenset:
    """The instruction sets the loaded CPU kernels were compiled with (e.g. {"avx2", "fma", "f16c"}),
    empty when none are loaded."""
    if _loaded is None:
        return frozenset()
    return frozenset(torch.ops.pagedgen.cpu_kernel_isa()[1:])
