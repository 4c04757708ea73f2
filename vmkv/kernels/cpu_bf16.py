"""bfloat16 linears and decoder layers on the CPU's matrix units (``csrc/cpu_bf16_layer.cpp``).

    linear(a, W)         a [M, K] bf16 -> a W^T + b: float32 (the LM head) or bf16
    attn_in(x)           rms_norm -> qkv GEMM (+ bias) -> RoPE on q, k  -> qkv [T, (Hq+2Hkv)*D]
    attn_out(x, attn)    o GEMM + residual, rms_norm, SiLU(gate) * up, down GEMM + residual

The products are oneDNN's brgemm ukernel, reached through torch's own export of it
(``at::native::cpublas::brgemm``, the AMX tile kernel torch's CPU flash attention uses): this
module looks its address up in ``libtorch_cpu`` and hands it to the C library, which tiles the
product over the OpenMP team and finishes each tile (bias, rounding, residual, SiLU*up) while it
is in cache. Weights are packed once at load (:func:`pack_weight`). :func:`available` is True
only where the CPU has bfloat16 hardware (AMX-BF16 or AVX512-BF16), torch exports the ukernel
and the library builds.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from vmkv.cpu_info import bf16_hardware
from vmkv.kernels.build import CPU_FLAGS, CSRC, load_cpu_library

SOURCE = CSRC / "cpu_bf16_layer.cpp"
LIBRARY = "vmkv_cpu_bf16_layer"
#: what runs where the library did not build
FALLBACK = "bfloat16 linears run through oneDNN, the decoder layers as torch modules"
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
#: ``ns`` counters of :class:`GemmArgs` (profiling): products (with their epilogues), the rest
GEMM_NS, ELEMENTWISE_NS = 0, 1
#: torch's exports of oneDNN's brgemm ukernel (C++ names, BFloat16 overload) and its release
_BRGEMM = "_ZN2at6native7cpublas6brgemmEllllllbPKN3c108BFloat16ES5_Pfb"
_RELEASE = "_ZN2at6native7cpublas14brgemm_releaseEb"


class LinearArgs(ctypes.Structure):
    """``VmkvBf16Linear``: a weight packed by :func:`pack_weight` and an optional bf16 bias."""

    _fields_ = [("packed", _PTR), ("bias", _PTR), ("in_features", _I64),
                ("out_features", _I64), ("block_n", _I64)]


class GemmArgs(ctypes.Structure):
    """``VmkvBf16Gemm``: the ukernel's addresses and ``ns`` (NULL, or two int64 counters)."""

    _fields_ = [("brgemm", _PTR), ("release", _PTR), ("ns", _PTR)]


class LayerArgs(ctypes.Structure):
    """``VmkvBf16Layer``: one layer's four packed linears and two norm weights."""

    _fields_ = [("qkv", LinearArgs), ("o", LinearArgs), ("gate_up", LinearArgs),
                ("down", LinearArgs), ("input_norm", _PTR), ("post_norm", _PTR)]


class ShapeArgs(ctypes.Structure):
    """``VmkvBf16Shape``: the model's geometry and the ukernel."""

    _fields_ = [("hidden", _I64), ("num_heads", _I64), ("num_kv_heads", _I64),
                ("head_dim", _I64), ("intermediate", _I64), ("eps", ctypes.c_float),
                ("gemm", GemmArgs)]


@functools.cache
def ukernel() -> tuple[int, int] | None:
    """Addresses of torch's brgemm (BFloat16) and brgemm_release, or None where it has none."""
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        brgemm, release = getattr(lib, _BRGEMM), getattr(lib, _RELEASE)
    except (OSError, AttributeError):
        return None
    return (ctypes.cast(brgemm, _PTR).value or 0, ctypes.cast(release, _PTR).value or 0)


@functools.cache
def _lib() -> ctypes.CDLL | None:
    lib = load_cpu_library(SOURCE, CPU_FLAGS, LIBRARY, FALLBACK)
    if lib is None:
        return None
    gemm, linear = ctypes.POINTER(GemmArgs), ctypes.POINTER(LinearArgs)
    shape, layer = ctypes.POINTER(ShapeArgs), ctypes.POINTER(LayerArgs)
    lib.vmkv_bf16_linear.argtypes = [gemm, linear, _PTR, _I64, _I64, _PTR, _I64, ctypes.c_int]
    lib.vmkv_bf16_attn_in.argtypes = [shape, layer, _PTR, _I64, _PTR, _PTR, _PTR, _PTR]
    lib.vmkv_bf16_attn_out.argtypes = [shape, layer, _PTR, _I64, _PTR, _I64, _PTR, _PTR]
    for fn in (lib.vmkv_bf16_linear, lib.vmkv_bf16_attn_in, lib.vmkv_bf16_attn_out):
        fn.restype = ctypes.c_int
    return lib


def unavailable_reason() -> str | None:
    """Why the bf16 kernels cannot run here (None when they can; builds the library)."""
    if not bf16_hardware():
        return "this CPU has no bfloat16 hardware (AMX-BF16 or AVX512-BF16)"
    if not torch.backends.mkldnn.is_available() or ukernel() is None:
        return "this torch does not export oneDNN's brgemm ukernel (at::native::cpublas)"
    if _lib() is None:
        return "the bf16 kernel library did not build (see the log)"
    return None


def available() -> bool:
    """Whether the bf16 kernels run here (see :func:`unavailable_reason`)."""
    return unavailable_reason() is None


def library() -> ctypes.CDLL:
    """The loaded library (RuntimeError when :func:`available` is False)."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"the CPU bf16 kernels are not available: {reason}")
    lib = _lib()
    assert lib is not None
    return lib


def gemm_args(ns: torch.Tensor | None = None) -> GemmArgs:
    """The ukernel's entry points, with profiling counters ``ns`` (int64 [2]) when given."""
    addresses = ukernel()
    if addresses is None:
        raise RuntimeError("this torch does not export oneDNN's brgemm ukernel")
    return GemmArgs(brgemm=addresses[0], release=addresses[1],
                    ns=ns.data_ptr() if ns is not None else None)


def block_n(out_features: int, parts: int = 1) -> int:
    """Output columns per packed block: the widest of 64, 32, 16 that divides each of the
    weight's ``parts`` equal parts (a fused gate|up weight: 2, so each half starts on a block),
    64 when none does (the last block is padded). 64 ran 3-10 % faster than 32 at prefill
    sizes (docs/benchmarks.md)."""
    part = out_features // parts if out_features % parts == 0 else out_features
    return next((bn for bn in (64, 32, 16) if part % bn == 0), 64)


def pack_weight(weight: torch.Tensor, bn: int) -> torch.Tensor:
    """``weight [N, K]`` (bf16, K even) as the ukernel's blocks ``[ceil(N/bn), K/2, bn, 2]``:
    block ``j`` is ``W^T[:, j*bn : (j+1)*bn]`` in VNNI pairs (rows ``2i`` and ``2i+1`` of
    ``W^T`` interleaved), columns past ``N`` zero."""
    n, k = weight.shape
    if k % 2:
        raise ValueError(f"a packed bf16 weight needs an even in_features, got {k}")
    blocks = -(-n // bn)
    padded = weight.new_zeros(blocks * bn, k)
    padded[:n] = weight
    return padded.view(blocks, bn, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def linear_args(packed: torch.Tensor, bias: torch.Tensor | None, in_features: int,
                out_features: int) -> LinearArgs:
    """The C view of a weight packed by :func:`pack_weight` (the caller keeps it alive)."""
    return LinearArgs(packed=packed.data_ptr(),
                      bias=bias.data_ptr() if bias is not None else None,
                      in_features=in_features, out_features=out_features,
                      block_n=packed.shape[2])


def linear(x: torch.Tensor, args: LinearArgs, gemm: GemmArgs, out_dtype: torch.dtype
           ) -> torch.Tensor:
    """``x [M, K]`` bf16 times the packed weight: ``[M, N]`` in ``out_dtype`` (float32 or
    bfloat16, rounded once)."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != args.in_features:
        raise ValueError(f"a bf16 linear takes bfloat16 [M, {args.in_features}], got "
                         f"{x.dtype} {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], args.out_features, dtype=out_dtype)
    err = library().vmkv_bf16_linear(ctypes.byref(gemm), ctypes.byref(args), x.data_ptr(),
                                     x.stride(0), x.shape[0], out.data_ptr(), out.stride(0),
                                     int(out_dtype == torch.bfloat16))
    if err:
        raise RuntimeError(f"the bf16 linear failed (code {err}) on {tuple(x.shape)}")
    return out
