"""Builds pagedgen._C: the op schemas (csrc/ops.cpp), the CPU kernels (csrc/cpu/*.cpp) and, when
torch has CUDA and the CUDA toolkit is found, the CUDA kernels (csrc/cuda/*.cu).

Install torch first and build without isolation (see ../README.md):
    pip install --no-build-isolation -e .
Environment:
    PAGEDGEN_NO_CUDA=1      build the CPU kernels only
    TORCH_CUDA_ARCH_LIST    CUDA architectures (default "8.0;9.0+PTX")
    PAGEDGEN_CPU_ARCH       value of -march for the CPU kernels (default "native"; "" to omit)
    MAX_JOBS                parallel compile jobs
"""
import glob
import os

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _extension():
    import torch
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
    use_cuda = (
        os.environ.get("PAGEDGEN_NO_CUDA", "0") != "1"
        and torch.version.cuda is not None
        and cpp_extension.CUDA_HOME is not None
    )
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


setup(ext_modules=[_extension()], cmdclass={"build_ext": _build_ext()})
