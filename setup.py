"""Builds pagedgen._C: the op schemas (csrc/ops.cpp), the CPU kernels (csrc/cpu/*.cpp) and, when
torch has CUDA and the CUDA toolkit is found (``find_cuda_home``), the CUDA kernels (csrc/cuda/*.cu).

Install torch first and build without isolation (see ../README.md):
    pip install --no-build-isolation -e .        # or: pip wheel --no-build-isolation --no-deps .
Environment:
    CUDA_HOME               the CUDA toolkit (found by itself otherwise, see find_cuda_home)
    PAGEDGEN_NO_CUDA=1      build the CPU kernels only
    TORCH_CUDA_ARCH_LIST    CUDA architectures (default "8.0;9.0+PTX")
    PAGEDGEN_CPU_ARCH       value of -march for the CPU kernels (default "native"; "" to omit)
    MAX_JOBS                parallel compile jobs
"""
import glob
import os
import re
import shutil
import sys
from typing import Optional

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


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


def _extension():
    import torch

    use_cuda = _use_cuda(torch)  # before cpp_extension is imported: it reads CUDA_HOME then
    from torch.utils import cpp_extension

    # op_checks.cpp: the argument checks every device's kernels share (csrc/op_checks.h).
    sources = [os.path.join("csrc", f) for f in ("ops.cpp", "op_checks.cpp")]
    sources += sorted(glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    # No -std flag: cpp_extension adds the standard the installed torch needs (C++20 for torch 2.14,
    # whose headers use std::strong_ordering; an explicit -std=c++17 breaks them).
    # -ffp-contract=off: a * b + c is a multiply and an add, each rounded, wherever the compiler inlines
    # it; fused multiply-adds are explicit (csrc/cpu/vec.h). The kernels' bitwise guarantees (batch
    # invariance, rotary_embedding equal to torch's) rest on this.
    cxx_flags = ["-O3", "-g0", "-fopenmp", "-ffp-contract=off"]
    march = os.environ.get("PAGEDGEN_CPU_ARCH", "native")
    if march:
        cxx_flags.append(f"-march={march}")
    if not use_cuda:
        return cpp_extension.CppExtension(
            "pagedgen._C", sources, extra_compile_args={"cxx": cxx_flags}, extra_link_args=["-fopenmp"]
        )
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
    include_dirs = []
    # Headers of the nvidia-* wheels torch installed (cusparse.h and friends), if present.
    for site in {os.path.dirname(os.path.dirname(torch.__file__))}:
        include_dirs += glob.glob(os.path.join(site, "nvidia", "cu*", "include"))
    # nvcc rejects -g0 ("Unknown option") and emits no debug info unless asked; no -std, as above.
    nvcc_flags = ["-O3", "--use_fast_math"]
    return cpp_extension.CUDAExtension(
        "pagedgen._C",
        sources,
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx_flags + ["-DPAGEDGEN_WITH_CUDA"], "nvcc": nvcc_flags},
        extra_link_args=["-fopenmp"],
    )


def _build_ext():
    from torch.utils.cpp_extension import BuildExtension

    return BuildExtension.with_options(use_ninja=True)


if __name__ == "__main__":  # pip's build backend runs this file as __main__; tests import find_cuda_home
    setup(ext_modules=[_extension()], cmdclass={"build_ext": _build_ext()})
