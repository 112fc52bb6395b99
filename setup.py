"""Build flatgrad: C++ CPU kernels always; CUDA kernels when torch has CUDA and nvcc is present.

Two extensions: ``flatgrad._C`` (the kernels, csrc/*.cpp and csrc/cuda/) and
``flatgrad._census`` (the counting CPU allocator of ``flatgrad.testing.census``,
csrc/census/), so that the production extension carries no measuring tool.

``FLATGRAD_BUILD_CUDA=0`` forces a CPU-only build and ``=1`` requires CUDA.
``TORCH_CUDA_ARCH_LIST`` is honoured (torch's own build helpers read it).
"""

import glob
import os

from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

import torch

ROOT = os.path.dirname(os.path.abspath(__file__))


def _want_cuda() -> bool:
    flag = os.environ.get("FLATGRAD_BUILD_CUDA", "auto").lower()
    possible = torch.version.cuda is not None and CUDA_HOME is not None
    if flag in ("0", "false", "no"):
        return False
    if flag in ("1", "true", "yes"):
        if not possible:
            raise RuntimeError(
                "FLATGRAD_BUILD_CUDA=1 but CUDA cannot be built: "
                f"torch.version.cuda={torch.version.cuda}, CUDA_HOME={CUDA_HOME}"
            )
        return True
    return possible


def _census() -> CppExtension:
    """The counting CPU allocator, a measuring tool for the tests, benches and demo."""
    return CppExtension("flatgrad._census", sorted(glob.glob("csrc/census/*.cpp")), extra_compile_args={"cxx": ["-O3"]})


def _kernels() -> list:
    cpp = sorted(glob.glob("csrc/*.cpp"))
    if not cpp:
        return []
    include = [os.path.join(ROOT, "csrc", "include")]
    # No -std=: torch's build helpers add the one its headers need (C++20 for torch 2.13 and 2.14).
    # No FMA contraction (bitwise parity with the reference); FP exception flags are
    # never read, so -fno-trapping-math lets gcc vectorise the branch-free casts.
    cxx = ["-O3", "-ffp-contract=off", "-fno-trapping-math", "-fopenmp"]
    if _want_cuda():
        nvcc = ["-O3", "--fmad=false", "-lineinfo"]
        return [
            CUDAExtension(
                "flatgrad._C",
                cpp + sorted(glob.glob("csrc/cuda/*.cu")),
                include_dirs=include,
                extra_compile_args={"cxx": cxx, "nvcc": nvcc},
                extra_link_args=["-fopenmp"],
            )
        ]
    return [
        CppExtension(
            "flatgrad._C",
            cpp,
            include_dirs=include,
            extra_compile_args={"cxx": cxx},
            extra_link_args=["-fopenmp"],
        )
    ]


def _extensions() -> list:
    kernels = _kernels()
    return kernels + [_census()] if kernels else []


setup(
    packages=find_packages(include=["flatgrad", "flatgrad.*"]),
    ext_modules=_extensions(),
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
