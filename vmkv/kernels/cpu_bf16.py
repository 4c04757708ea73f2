"""Linears and decoder layers on oneDNN's brgemm ukernel (``csrc/cpu_bf16_layer.cpp``): bfloat16
on the CPU's matrix units, and float32 on AVX-512 (the ``brgemm`` linear backend of both dtypes).

    linear(a, W)         a [M, K] bf16 -> a W^T + b: float32 (the LM head) or bf16
    attn_in(x)           rms_norm -> qkv GEMM (+ bias) -> RoPE on q, k  -> qkv [T, (Hq+2Hkv)*D]
    attn_out(x, attn)    o GEMM + residual, rms_norm, SiLU(gate) * up, down GEMM + residual
                         (a Gemma 3 layer, ``LayerArgs.gemma``: its sandwich and q/k norms,
                         tanh-GELU(gate) * up)

The products are oneDNN's brgemm ukernel, reached through torch's own export of it
(``at::native::cpublas::brgemm``, the AMX tile kernel torch's CPU flash attention uses): this
module looks its address up in ``libtorch_cpu`` and hands it to the C library, which tiles the
product over the OpenMP team and finishes each tile (bias, rounding, residual, SiLU*up) while it
is in cache. Weights are packed once at load (:func:`pack_weight`). :func:`available` is True
only where the CPU has bfloat16 hardware (AMX-BF16 or AVX512-BF16), torch exports the ukernel
and the library builds. In float32 (``vmkv_f32_*``, the ukernel's float overload, plain weight
blocks) the same calls follow the unfused float32 layer operation for operation;
:func:`unavailable_reason` of ``torch.float32`` asks for AVX-512 (where it was measured).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from vmkv.cpu_info import bf16_hardware, cpu_features
from vmkv.kernels.build import CPU_FLAGS, CSRC, load_cpu_library

SOURCE = CSRC / "cpu_bf16_layer.cpp"
LIBRARY = "vmkv_cpu_bf16_layer"
#: what runs where the library did not build
FALLBACK = "bfloat16 linears run through oneDNN, the decoder layers as torch modules"
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
#: ``ns`` counters of :class:`GemmArgs` (profiling): products (with their epilogues), the rest
GEMM_NS, ELEMENTWISE_NS = 0, 1
#: torch's exports of oneDNN's brgemm ukernel (C++ names: the BFloat16 and float overloads, and
#: under uint8 the u8 x s8 -> s32 one the int8 LM head calls) and its release
_BRGEMM = {torch.bfloat16: "_ZN2at6native7cpublas6brgemmEllllllbPKN3c108BFloat16ES5_Pfb",
           torch.float32: "_ZN2at6native7cpublas6brgemmEllllllbPKfS3_Pfb",
           torch.uint8: "_ZN2at6native7cpublas6brgemmEllllllbPKhPKaPib"}
_RELEASE = "_ZN2at6native7cpublas14brgemm_releaseEb"
#: the C entry points' prefix by dtype
_PREFIX = {torch.bfloat16: "vmkv_bf16", torch.float32: "vmkv_f32"}


class LinearArgs(ctypes.Structure):
    """``VmkvBf16Linear``: a weight packed by :func:`pack_weight` and an optional bias (both
    of the linear's dtype)."""

    _fields_ = [("packed", _PTR), ("bias", _PTR), ("in_features", _I64),
                ("out_features", _I64), ("block_n", _I64)]


class GemmArgs(ctypes.Structure):
    """``VmkvBf16Gemm``: the ukernel's addresses and ``ns`` (NULL, or two int64 counters)."""

    _fields_ = [("brgemm", _PTR), ("release", _PTR), ("ns", _PTR)]


class GemmaNormArgs(ctypes.Structure):
    """``VmkvGemmaNorms``: a Gemma 3 layer's six norm scales (``1 + w``, float32)."""

    _fields_ = [(name, _PTR) for name in ("input", "post_attn", "pre_ffw", "post_ffw", "q", "k")]


class LayerArgs(ctypes.Structure):
    """``VmkvBf16Layer``: one layer's four packed linears and two norm weights; ``gemma``
    (a :class:`GemmaNormArgs` pointer) makes it a Gemma 3 layer (NULL: Llama's)."""

    _fields_ = [("qkv", LinearArgs), ("o", LinearArgs), ("gate_up", LinearArgs),
                ("down", LinearArgs), ("input_norm", _PTR), ("post_norm", _PTR),
                ("gemma", ctypes.POINTER(GemmaNormArgs))]


class ShapeArgs(ctypes.Structure):
    """``VmkvBf16Shape``: the model's geometry and the ukernel."""

    _fields_ = [("hidden", _I64), ("num_heads", _I64), ("num_kv_heads", _I64),
                ("head_dim", _I64), ("intermediate", _I64), ("eps", ctypes.c_float),
                ("gemm", GemmArgs)]


@functools.cache
def ukernel(dtype: torch.dtype = torch.bfloat16) -> tuple[int, int] | None:
    """Addresses of torch's brgemm (``dtype``'s overload; uint8: u8 x s8) and brgemm_release,
    or None where it has none."""
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        brgemm, release = getattr(lib, _BRGEMM[dtype]), getattr(lib, _RELEASE)
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
    for prefix in _PREFIX.values():
        linear_fn, attn_in, attn_out = (getattr(lib, f"{prefix}_{name}")
                                        for name in ("linear", "attn_in", "attn_out"))
        linear_fn.argtypes = [gemm, linear, _PTR, _I64, _I64, _PTR, _I64, ctypes.c_int]
        attn_in.argtypes = [shape, layer, _PTR, _I64, _PTR, _PTR, _PTR, _PTR]
        attn_out.argtypes = [shape, layer, _PTR, _I64, _PTR, _I64, _PTR, _PTR]
        for fn in (linear_fn, attn_in, attn_out):
            fn.restype = ctypes.c_int
    return lib


@functools.cache
def unavailable_reason(dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why the ``dtype`` (bfloat16 or float32) kernels cannot run here (None when they can;
    builds the library). Cached: every brgemm linear call asks it."""
    if dtype == torch.bfloat16 and not bf16_hardware():
        return "this CPU has no bfloat16 hardware (AMX-BF16 or AVX512-BF16)"
    if dtype == torch.float32 and "avx512f" not in cpu_features().split():
        return "float32 brgemm is used on AVX-512 CPUs only (where it was measured)"
    if not torch.backends.mkldnn.is_available() or ukernel(dtype) is None:
        return "this torch does not export oneDNN's brgemm ukernel (at::native::cpublas)"
    if _lib() is None:
        return "the brgemm kernel library did not build (see the log)"
    return None


def available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the ``dtype`` kernels run here (see :func:`unavailable_reason`)."""
    return unavailable_reason(dtype) is None


def library(dtype: torch.dtype = torch.bfloat16) -> ctypes.CDLL:
    """The loaded library (RuntimeError when :func:`available` is False for ``dtype``)."""
    reason = unavailable_reason(dtype)
    if reason is not None:
        raise RuntimeError(f"the CPU brgemm kernels are not available: {reason}")
    lib = _lib()
    assert lib is not None
    return lib


def entry(lib: ctypes.CDLL, dtype: torch.dtype, name: str) -> ctypes._CFuncPtr:
    """The library's ``name`` call ("linear", "attn_in", "attn_out") for ``dtype``."""
    return getattr(lib, f"{_PREFIX[dtype]}_{name}")


def gemm_args(ns: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16) -> GemmArgs:
    """The ukernel's entry points for ``dtype``, with profiling counters ``ns`` (int64 [2]) when
    given."""
    addresses = ukernel(dtype)
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
    """``weight [N, K]`` as the ukernel's blocks, block ``j`` being ``W^T[:, j*bn : (j+1)*bn]``
    (columns past ``N`` zero): bf16 (K even) ``[ceil(N/bn), K/2, bn, 2]`` in VNNI pairs (rows
    ``2i`` and ``2i+1`` of ``W^T`` interleaved); float32 ``[ceil(N/bn), K, bn]``."""
    n, k = weight.shape
    if weight.dtype == torch.bfloat16 and k % 2:
        raise ValueError(f"a packed bf16 weight needs an even in_features, got {k}")
    blocks = -(-n // bn)
    padded = weight.new_zeros(blocks * bn, k)
    padded[:n] = weight
    if weight.dtype == torch.float32:
        return padded.view(blocks, bn, k).transpose(1, 2).contiguous()
    return padded.view(blocks, bn, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def block_width(packed: torch.Tensor) -> int:
    """Output columns per block of a weight packed by :func:`pack_weight`."""
    return packed.shape[2]


def packed_in_features(packed: torch.Tensor) -> int:
    """``K`` of a weight packed by :func:`pack_weight`."""
    return packed.shape[1] * (2 if packed.dtype == torch.bfloat16 else 1)


def linear_args(packed: torch.Tensor, bias: torch.Tensor | None, in_features: int,
                out_features: int) -> LinearArgs:
    """The C view of a weight packed by :func:`pack_weight` (the caller keeps it alive)."""
    return LinearArgs(packed=packed.data_ptr(),
                      bias=bias.data_ptr() if bias is not None else None,
                      in_features=in_features, out_features=out_features,
                      block_n=block_width(packed))


def linear(x: torch.Tensor, args: LinearArgs, gemm: GemmArgs, out_dtype: torch.dtype,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K]`` (bf16 or float32, the weight's dtype, with ``gemm`` of that dtype) times the
    packed weight: ``[M, N]`` in ``out_dtype`` (bf16 x: float32 or bfloat16, rounded once;
    float32 x: float32), written into ``out`` when given (``[M, N]`` of that dtype, rows
    contiguous) and returned."""
    if x.dtype not in _PREFIX or x.dim() != 2 or x.shape[1] != args.in_features:
        raise ValueError(f"a brgemm linear takes bfloat16 or float32 [M, {args.in_features}], "
                         f"got {x.dtype} {tuple(x.shape)}")
    if x.dtype == torch.float32 and out_dtype != torch.float32:
        raise ValueError(f"a float32 brgemm linear gives float32, not {out_dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    shape = (x.shape[0], args.out_features)
    if out is None:
        out = torch.empty(shape, dtype=out_dtype)
    elif tuple(out.shape) != shape or out.dtype != out_dtype or out.stride(1) != 1:
        raise ValueError(f"out must be {out_dtype} {shape} with contiguous rows, got "
                         f"{out.dtype} {tuple(out.shape)} strides {out.stride()}")
    err = entry(library(x.dtype), x.dtype, "linear")(
        ctypes.byref(gemm), ctypes.byref(args), x.data_ptr(), x.stride(0), x.shape[0],
        out.data_ptr(), out.stride(0), int(out_dtype == torch.bfloat16))
    if err:
        raise RuntimeError(f"the brgemm linear failed (code {err}) on {tuple(x.shape)}")
    return out
