"""Builds pagedgen's extension: ``pagedgen._C``, the op schemas (csrc/ops.cpp), the CPU feature check
(csrc/cpu_features.cpp) and, when torch has CUDA and the CUDA toolkit is found (``find_cuda_home``), the
CUDA kernels (csrc/cuda/*.cu), compiled for any CPU of the architecture; and the CPU kernels
(csrc/cpu/*.cpp), compiled once per instruction-set level into ``pagedgen._C_cpu_<level>`` (``CPU_LEVELS``).
pagedgen/ops/isa.py loads the best level the CPU and its OS run at import (``PAGEDGEN_CPU_ISA`` forces a
lower one), so one wheel runs on every x86-64 CPU with AVX2, each at its own level's speed.

Install torch first and build without isolation (see ../README.md):
    pip install --no-build-isolation -e .        # or: pip wheel --no-build-isolation --no-deps .
Environment:
    CUDA_HOME               the CUDA toolkit (found by itself otherwise, see find_cuda_home)
    PAGEDGEN_NO_CUDA=1      build the CPU kernels only
    TORCH_CUDA_ARCH_LIST    CUDA architectures (default "8.0;9.0+PTX")
    PAGEDGEN_CPU_LEVELS     the CPU kernel levels to build, comma-separated (default on x86-64:
                            "avx2,avx512_bf16,amx"; elsewhere "generic"); "native" builds one more
                            level with -march=native, for this machine only (chosen only when asked
                            for: PAGEDGEN_CPU_ISA=native)
    MAX_JOBS                parallel compile jobs
    PAGEDGEN_SKIP_EXT=1     build no extension (scripts/setup.sh: the editable install of a checkout whose
                            extension `setup.py build_ext --inplace` already built, objects kept in build/)
"""
import glob
import os
import platform
import re
import shutil
import sys
from typing import Optional

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))

#: The CPU kernel levels of a wheel on x86-64, lowest first, and the compiler flags of each: the x86-64
#: micro-architecture levels of the System V ABI, plus the instruction sets pagedgen's kernels use.
#: csrc/cpu_features.cpp checks the same sets (cpuid and the OS's XCR0) before a level is loaded.
CPU_LEVELS = {
    "avx2": ["-march=x86-64-v3"],
    "avx512_bf16": ["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"],
    "amx": ["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16", "-mamx-int8"],
}
#: Levels that are not in a wheel: this machine's own (-march=native) and, on other architectures, the
#: compiler's default for the target.
OTHER_LEVELS = {"native": ["-march=native"], "generic": []}


def cpu_levels() -> dict:
    """The CPU kernel levels to build, with their flags: ``PAGEDGEN_CPU_LEVELS`` (comma-separated names of
    ``CPU_LEVELS`` and ``OTHER_LEVELS``) or, by default, every level of ``CPU_LEVELS`` on x86-64 and
    "generic" elsewhere. Raises ValueError naming an unknown level."""
    text = os.environ.get("PAGEDGEN_CPU_LEVELS", "").strip()
    if not text:
        names = list(CPU_LEVELS) if platform.machine().lower() in ("x86_64", "amd64") else ["generic"]
    else:
        names = [n.strip() for n in text.split(",") if n.strip()]
    known = {**CPU_LEVELS, **OTHER_LEVELS}
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"PAGEDGEN_CPU_LEVELS={text!r}: expected a comma-separated list of {sorted(known)}, "
                         f"got unknown {unknown}")
    return {n: known[n] for n in names}


def is_cuda_toolkit(folder: str) -> bool:
    """True when ``folder`` holds a CUDA toolkit: an executable bin/nvcc and lib64/libcudart* (or lib/,
    or targets/<arch>/lib/, which lib64 usually links to)."""
    return os.access(os.path.join(folder, "bin", "nvcc"), os.X_OK) and any(
        glob.glob(os.path.join(folder, lib, "libcudart*")) for lib in ("lib64", "lib", os.path.join("targets", "*", "lib"))
    )


def _toolkit_of_nvcc(nvcc: str) -> Optional[str]:
    """The toolkit that the nvcc at ``nvcc`` runs: its own folder's parent, that of the file a symlink
    points to, or that of the nvcc a small wrapper script execs (``exec /usr/local/cuda-13.0/bin/nvcc``)."""
    for path in (nvcc, os.path.realpath(nvcc)):
        folder = os.path.dirname(os.path.dirname(path))
        if is_cuda_toolkit(folder):
            return folder
    try:
        with open(nvcc, "rb") as f:
            head = f.read(4096)
    except OSError:
        return None
    if not head.startswith(b"#!"):  # a binary outside a toolkit: nothing to follow
        return None
    for target in re.findall(rb"(/[^\s'\"]*)/bin/nvcc\b", head):
        folder = target.decode(errors="replace")
        if is_cuda_toolkit(folder):
            return folder
    return None


def find_cuda_home() -> Optional[str]:
    """The CUDA toolkit to compile csrc/cuda with, or None when there is none.

    In order: ``CUDA_HOME`` (or ``CUDA_PATH``) when it holds a toolkit; the toolkit of the ``nvcc`` on
    the PATH, following a symlink or a wrapper script; /usr/local/cuda; the newest /usr/local/cuda-*.
    (torch's own guess is the parent of the PATH's nvcc folder: for a wrapper in /usr/local/bin that
    is /usr/local, and the link fails with ``cannot find -lcudart``.)
    """
    for var in ("CUDA_HOME", "CUDA_PATH"):
        folder = os.environ.get(var)
        if folder:
            if is_cuda_toolkit(folder):
                return folder
            print(f"pagedgen setup: {var}={folder!r} holds no CUDA toolkit (bin/nvcc and lib64/libcudart*); "
                  "looking elsewhere", file=sys.stderr)
    nvcc = shutil.which("nvcc")
    if nvcc is not None:
        folder = _toolkit_of_nvcc(nvcc)
        if folder is not None:
            return folder
    versioned = sorted(glob.glob("/usr/local/cuda-*"), key=lambda p: [int(x) for x in re.findall(r"\d+", p)], reverse=True)
    for folder in ["/usr/local/cuda"] + versioned:
        if is_cuda_toolkit(folder):
            return folder
    return None


def _use_cuda(torch) -> bool:
    """Whether to build the CUDA kernels; when so, ``CUDA_HOME`` is the toolkit found, for cpp_extension."""
    if os.environ.get("PAGEDGEN_NO_CUDA", "0") == "1" or torch.version.cuda is None:
        return False
    cuda_home = find_cuda_home()
    if cuda_home is None:
        print(f"pagedgen setup: WARNING: torch {torch.__version__} has CUDA but no CUDA toolkit was found "
              "(set CUDA_HOME to a folder with bin/nvcc and lib64/libcudart*); building the CPU kernels "
              "only, so pagedgen will run on CUDA devices through the slow PyTorch reference ops",
              file=sys.stderr)
        return False
    # cpp_extension reads CUDA_HOME once, when it is first imported; set both in case it already was.
    os.environ["CUDA_HOME"] = cuda_home
    from torch.utils import cpp_extension

    cpp_extension.CUDA_HOME = cuda_home
    print(f"pagedgen setup: building the CUDA kernels with the toolkit in {cuda_home}", file=sys.stderr)
    return True


def _extensions():
    import torch

    use_cuda = _use_cuda(torch)  # before cpp_extension is imported: it reads CUDA_HOME then
    from torch.utils import cpp_extension

    # No -std flag: cpp_extension adds the standard the installed torch needs (C++20 for torch 2.14,
    # whose headers use std::strong_ordering; an explicit -std=c++17 breaks them).
    # -ffp-contract=off: a * b + c is a multiply and an add, each rounded, wherever the compiler inlines
    # it; fused multiply-adds are explicit (csrc/cpu/vec.h). The kernels' bitwise guarantees (batch
    # invariance, rotary_embedding equal to torch's) rest on this.
    base_flags = ["-O3", "-g0", "-ffp-contract=off"]
    # The CPU kernels, one module per level. Each module is its own shared library, and exactly one is
    # loaded in a process (pagedgen/ops/isa.py), so the inline functions of the headers, compiled with
    # each level's flags, never mix (one library built from objects of several levels could link an
    # AVX-512 copy of a header's function into the code an AVX2 CPU runs). op_checks.cpp is in each.
    # (In one compilation unit with the other kernels: csrc/cpu_kernels.cpp.)
    # Two compilation units per level (csrc/cpu_kernels.cpp says why): the rest, and attention.cpp.
    cpu_sources = [os.path.join("csrc", "cpu_kernels.cpp"), os.path.join("csrc", "cpu", "attention.cpp")]
    cpu_modules = [
        cpp_extension.CppExtension(
            f"pagedgen._C_cpu_{level}", cpu_sources,
            extra_compile_args={"cxx": base_flags + ["-fopenmp", f"-DPAGEDGEN_CPU_LEVEL={level}"] + flags},
            extra_link_args=["-fopenmp"],
        )
        for level, flags in cpu_levels().items()
    ]
    # The baseline module: schemas, the CPU feature check and, with CUDA, the CUDA kernels and their
    # argument checks; compiled for any CPU of the architecture.
    sources = [os.path.join("csrc", f) for f in ("ops.cpp", "op_checks.cpp", "cpu_features.cpp")]
    if not use_cuda:
        return [cpp_extension.CppExtension("pagedgen._C", sources, extra_compile_args={"cxx": base_flags})] + cpu_modules
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
    include_dirs = []
    # Headers of the nvidia-* wheels torch installed (cusparse.h and friends), if present.
    for site in {os.path.dirname(os.path.dirname(torch.__file__))}:
        include_dirs += glob.glob(os.path.join(site, "nvidia", "cu*", "include"))
    # nvcc rejects -g0 ("Unknown option") and emits no debug info unless asked; no -std, as above.
    nvcc_flags = ["-O3", "--use_fast_math"]
    cuda_module = cpp_extension.CUDAExtension(
        "pagedgen._C",
        sources,
        include_dirs=include_dirs,
        extra_compile_args={"cxx": base_flags + ["-DPAGEDGEN_WITH_CUDA"], "nvcc": nvcc_flags},
    )
    return [cuda_module] + cpu_modules


def _build_ext():
    from torch.utils.cpp_extension import BuildExtension

    class Build(BuildExtension):
        """cpp_extension's build, each module's objects in a folder of its own: the CPU modules compile the
        same sources with other flags, and one folder would make each module's build overwrite the last's
        objects (and rebuild them all every time)."""

        def build_extension(self, ext):
            base = self.build_temp
            self.build_temp = os.path.join(base, ext.name.rsplit(".", 1)[-1])
            try:
                super().build_extension(ext)
            finally:
                self.build_temp = base

    return Build.with_options(use_ninja=True)


if __name__ == "__main__":  # pip's build backend runs this file as __main__; tests import find_cuda_home
    skip = os.environ.get("PAGEDGEN_SKIP_EXT", "0") == "1"
    setup(ext_modules=[] if skip else _extensions(), cmdclass={} if skip else {"build_ext": _build_ext()})
