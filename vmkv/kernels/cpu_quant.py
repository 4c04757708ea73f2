"""Linears and decoder layers on GGUF block-quantized weights (``csrc/cpu_quant_layer.cpp``).

    linear(x, W)        x [M, K] float32 or bf16 -> x W^T + b: float32 (the LM head) or x's dtype
    embed(ids, W)       the rows ``ids`` of an embedding table kept in its blocks
    attn_in / attn_out  the fused decoder layer's two calls (vmkv.models.fused_layers)

Weights stay in the file's formats (Q8_0, Q4_0, Q4_1, Q5_0; U8 for ``--quantization int8``),
rearranged at load into groups of 16 output rows (:mod:`vmkv.models.quant.packing`: the same
bytes); each product quantises its activations per block of 32 to int8 and sums integer dot
products (AVX-512 VNNI, AVX2, or portable loops: the compiler's choice by ``-march``; every
build gives the same bits, the bf16 tiles apart). From :data:`TILE_ROWS` rows of bfloat16
activations on (prefill, wide batches), where oneDNN's bf16 brgemm ukernel runs
(:mod:`vmkv.kernels.cpu_bf16`), a product instead dequantizes each block of 32 output rows once
into a bf16 tile and multiplies it on the ukernel; on AVX2 builds (no VNNI), from
:data:`I16_TILE_ROWS` rows on, each group of 16 output rows is widened once into int16 codes and
multiplied with the activations' codes by vpmaddwd (``csrc/cpu_quant_i16_tiles.h``: the same
results as the integer products, bit for bit). Built like the
other CPU kernels (g++, cached; :mod:`vmkv.kernels.build`). Where the library cannot be built,
:func:`available` is False (one warning line says why) and a GGUF model is dequantized at load
instead (``--quantization none``).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from pathlib import Path

import torch

from vmkv import envs
from vmkv.kernels import cpu_bf16
from vmkv.kernels.build import CPU_FLAGS, CSRC, load_cpu_library

SOURCE = CSRC / "cpu_quant_layer.cpp"
LIBRARY = "vmkv_cpu_quant_layer"
#: what runs where the library did not build
FALLBACK = "GGUF weights are dequantized at load (--quantization none)"
FLAGS = CPU_FLAGS
_I64, _I32, _PTR = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
#: the C entry points' prefix by activation dtype
_PREFIX = {torch.float32: "vmkv_qf32", torch.bfloat16: "vmkv_qbf16"}
#: ``ns`` counters (profiling): products (activation quantisation included), the rest, and
#: the attention kernel's calls from ``decode_layers``
GEMM_NS, ELEMENTWISE_NS, ATTENTION_NS = 0, 1, 2
#: the entry points' code when the brgemm ukernel raised
UKERNEL_FAILED = 4
MAX_SEGMENTS = 3
#: bf16 products of at least this many rows take dequantized tiles and the brgemm ukernel
#: (AVX512-BF16 builds where the ukernel runs); fewer rows, and float32 activations, keep the
#: integer products (measured in docs/models.md, "Quantized weights")
TILE_ROWS = 16
#: products of at least this many rows take the int16 tiles (AVX2 builds without AVX-512, whose
#: integer products lack VNNI; the same results; measured in docs/models.md, "Quantized
#: weights"); elsewhere, and below it, the integer products. VMKV_QUANT_I16_TILE_ROWS sets it
#: (0: off), read when the library is built
I16_TILE_ROWS = int(envs.VMKV_QUANT_I16_TILE_ROWS.default or 0)


class Segment(ctypes.Structure):
    """``VmkvQSegment``: rows of one linear packed in one format (a GGML type id)."""

    _fields_ = [("packed", _PTR), ("rows", _I64), ("format", _I32), ("reserved", _I32)]


class LinearArgs(ctypes.Structure):
    """``VmkvQLinear``: up to three segments whose rows in order make the outputs, and an
    optional bias of the activations' dtype."""

    _fields_ = [("segments", Segment * MAX_SEGMENTS), ("num_segments", _I64), ("bias", _PTR),
                ("in_features", _I64), ("out_features", _I64)]


class LayerArgs(ctypes.Structure):
    """``VmkvQLayer``: one layer's four quantized linears and two norm weights."""

    _fields_ = [("qkv", LinearArgs), ("o", LinearArgs), ("gate_up", LinearArgs),
                ("down", LinearArgs), ("input_norm", _PTR), ("post_norm", _PTR)]


class ShapeArgs(ctypes.Structure):
    """``VmkvQShape``: the model's geometry and ``ns`` (NULL, or three int64 counters)."""

    _fields_ = [("hidden", _I64), ("num_heads", _I64), ("num_kv_heads", _I64),
                ("head_dim", _I64), ("intermediate", _I64), ("eps", ctypes.c_float),
                ("ns", _PTR)]


class DecodeArgs(ctypes.Structure):
    """``VmkvQDecode``: a pure-decode step's attention for :func:`decode_layers` (the decode
    kernel's address, each layer's K/V rows and window, the step's addressing)."""

    _fields_ = [("attention", _PTR), ("dtype", _I64), ("k", _PTR), ("v", _PTR),
                ("windows", _PTR), ("stride_row", _I64), ("stride_head", _I64),
                ("starts", _PTR), ("table", _PTR), ("table_stride", _I64),
                ("block_size", _I64), ("seq_lens", _PTR), ("scale", ctypes.c_float)]


@functools.cache
def build(flags: tuple[str, ...] = FLAGS, source: Path = SOURCE) -> ctypes.CDLL | None:
    """The library built from ``source`` (another revision's copy, for an A/B) with ``flags``
    (cached); None where it cannot be built (the reason:
    ``vmkv.kernels.build.load_failure(LIBRARY)``). Tests build each code path the CPU can run
    (``-mno-avx512f``, ``-mno-avx2``)."""
    lib = load_cpu_library(source, flags, LIBRARY, FALLBACK)
    if lib is None:
        return None
    linear, layer, shape = (ctypes.POINTER(LinearArgs), ctypes.POINTER(LayerArgs),
                            ctypes.POINTER(ShapeArgs))
    for prefix in _PREFIX.values():
        fns = {name: getattr(lib, f"{prefix}_{name}")
               for name in ("linear", "embed", "attn_in", "attn_out", "decode_layers")}
        fns["linear"].argtypes = [linear, _PTR, _I64, _I64, _PTR, _I64, ctypes.c_int, _PTR]
        fns["embed"].argtypes = [linear, _PTR, _I64, _PTR]
        fns["attn_in"].argtypes = [shape, layer, _PTR, _I64, _PTR, _PTR, _PTR, _PTR]
        fns["attn_out"].argtypes = [shape, layer, _PTR, _I64, _PTR, _I64, _PTR, _PTR]
        fns["decode_layers"].argtypes = [shape, layer, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _PTR,
                                         _PTR, _PTR, ctypes.POINTER(DecodeArgs)]
        for fn in fns.values():
            fn.restype = ctypes.c_int
    lib.vmkv_q_path.restype = ctypes.c_char_p
    lib.vmkv_q_set_ukernel.argtypes = [_PTR, _PTR, _I64]
    lib.vmkv_q_set_ukernel.restype = ctypes.c_int
    lib.vmkv_q_set_i16_tiles.argtypes = [_I64]
    lib.vmkv_q_set_i16_tiles.restype = ctypes.c_int
    use_ukernel(lib)
    use_i16_tiles(lib)
    return lib


def use_ukernel(lib: ctypes.CDLL, min_rows: int = TILE_ROWS) -> bool:
    """Give ``lib``'s bfloat16 products of ``min_rows`` rows or more (0: none) dequantized
    tiles and oneDNN's bf16 brgemm ukernel where it runs here
    (:func:`vmkv.kernels.cpu_bf16.unavailable_reason`); whether they now take them (False where
    the build has no tiles, not AVX512-BF16, or the ukernel does not run)."""
    found = (cpu_bf16.ukernel(torch.bfloat16)
             if cpu_bf16.unavailable_reason(torch.bfloat16) is None else None)
    brgemm, release = found or (None, None)
    return lib.vmkv_q_set_ukernel(brgemm, release, min_rows) == 0 and bool(found) and min_rows > 0


def use_i16_tiles(lib: ctypes.CDLL, min_rows: int | None = None) -> bool:
    """Give ``lib``'s products of ``min_rows`` rows or more (0: none; None:
    VMKV_QUANT_I16_TILE_ROWS, default :data:`I16_TILE_ROWS`) the int16 tiles (the same results
    as the integer products, faster without VNNI); whether they now take them (False where the
    build has none: only AVX2 builds without AVX-512 do)."""
    rows = envs.quant_i16_tile_rows() if min_rows is None else min_rows
    return lib.vmkv_q_set_i16_tiles(rows) == 0 and rows > 0


def _lib() -> ctypes.CDLL | None:
    return build(FLAGS)


def available() -> bool:
    """Whether the library builds and loads here (builds it on the first call)."""
    return _lib() is not None


def library() -> ctypes.CDLL:
    """The loaded library (RuntimeError when :func:`available` is False)."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("the CPU quantized-weight kernels are not available (see the log)")
    return lib


def code_path() -> str:
    """The build's product loops: ``avx512-vnni``, ``avx2`` or ``portable``."""
    return library().vmkv_q_path().decode()


def entry(dtype: torch.dtype, name: str) -> ctypes._CFuncPtr:
    """The call ``name`` (linear, embed, attn_in, attn_out, decode_layers) for activations of
    ``dtype``."""
    if dtype not in _PREFIX:
        raise ValueError(f"quantized kernels take float32 or bfloat16 activations, got {dtype}")
    return getattr(library(), f"{_PREFIX[dtype]}_{name}")


def linear_args(segments: Sequence[tuple[torch.Tensor, int, int]], bias: torch.Tensor | None,
                in_features: int) -> LinearArgs:
    """The C view of a quantized linear: ``segments`` = ``(packed, rows, format)`` each (the
    caller keeps the tensors alive)."""
    if not 1 <= len(segments) <= MAX_SEGMENTS:
        raise ValueError(f"a quantized linear has 1-{MAX_SEGMENTS} segments, got {len(segments)}")
    args = LinearArgs(num_segments=len(segments),
                      bias=bias.data_ptr() if bias is not None else None,
                      in_features=in_features, out_features=sum(r for _, r, _ in segments))
    for i, (packed, rows, fmt) in enumerate(segments):
        args.segments[i] = Segment(packed=packed.data_ptr(), rows=rows, format=fmt)
    return args


def linear(x: torch.Tensor, args: LinearArgs, out_dtype: torch.dtype,
           ns: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K]`` (float32 or bf16) times the quantized weight: ``[M, N]`` in ``out_dtype``
    (float32, or x's dtype rounded once)."""
    if x.dim() != 2 or x.shape[1] != args.in_features or x.dtype not in _PREFIX:
        raise ValueError(f"a quantized linear takes float32 or bfloat16 [M, {args.in_features}],"
                         f" got {x.dtype} {tuple(x.shape)}")
    if out_dtype not in (torch.float32, x.dtype):
        raise ValueError(f"a quantized linear gives float32 or {x.dtype}, not {out_dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], args.out_features, dtype=out_dtype)
    rounded = int(out_dtype == x.dtype and x.dtype != torch.float32)
    err = entry(x.dtype, "linear")(ctypes.byref(args), x.data_ptr(), x.stride(0), x.shape[0],
                                   out.data_ptr(), out.stride(0), rounded,
                                   ns.data_ptr() if ns is not None else None)
    if err == UKERNEL_FAILED:
        raise RuntimeError(f"oneDNN's brgemm ukernel failed on {tuple(x.shape)}")
    if err:
        raise ValueError(f"the quantized linear refused {tuple(x.shape)} (bad weight arguments)")
    return out


def embed(ids: torch.Tensor, args: LinearArgs, dtype: torch.dtype) -> torch.Tensor:
    """The rows ``ids [T]`` (int64) of a one-segment quantized table: ``[T, K]`` in ``dtype``
    (ValueError for an id outside the table)."""
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty(ids.shape[0], args.in_features, dtype=dtype)
    if entry(dtype, "embed")(ctypes.byref(args), ids.data_ptr(), ids.shape[0], out.data_ptr()):
        raise ValueError(f"token ids outside the embedding's {args.out_features} rows")
    return out
