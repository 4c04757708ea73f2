"""A decoder layer's work around its attention in two C calls (``csrc/cpu_decoder_layer.cpp``).

    attn_in(x)          rms_norm -> qkv GEMM (+ bias) -> RoPE on q, k     -> qkv  [T, (Hq+2Hkv)*D]
    (the engine's attention backend, unchanged)                            -> attn [T, Hq*D]
    attn_out(x, attn)   o GEMM, residual, rms_norm, gate_up GEMM, SiLU*up,
                        down GEMM, residual                                -> x updated in place

The GEMMs are MKL's packed compute on the weights :class:`~vmkv.models.linear.PackedLinear`
packed at load; the library gets ``cblas_sgemm_compute``'s address from torch's own
``libtorch_cpu`` (:func:`vmkv.models.linear.mkl_compute_address`). Built like the other CPU
kernels (g++, cached; :mod:`vmkv.kernels.build`); where it cannot be built :func:`available` is
False (one warning says why) and the model runs its layers as torch modules.
"""

from __future__ import annotations

import ctypes
import functools

from vmkv.kernels.build import CPU_FLAGS, CSRC, load_cpu_library

SOURCE = CSRC / "cpu_decoder_layer.cpp"
LIBRARY = "vmkv_cpu_decoder_layer"
#: what runs without the library
FALLBACK = "the decoder layers run as torch modules"
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
#: ``ns`` counters of :class:`LayerShape` (profiling): GEMMs, elementwise loops
GEMM_NS, ELEMENTWISE_NS = 0, 1


class PackedLinearArgs(ctypes.Structure):
    """``VmkvPackedLinear``: an MKL-packed weight ``W^T [in, out]`` and an optional bias."""

    _fields_ = [("packed", _PTR), ("bias", _PTR), ("in_features", _I64),
                ("out_features", _I64)]


class DecoderLayerArgs(ctypes.Structure):
    """``VmkvDecoderLayer``: one layer's four packed linears and two norm weights."""

    _fields_ = [("qkv", PackedLinearArgs), ("o", PackedLinearArgs),
                ("gate_up", PackedLinearArgs), ("down", PackedLinearArgs),
                ("input_norm", _PTR), ("post_norm", _PTR)]


class LayerShape(ctypes.Structure):
    """``VmkvLayerShape``: the model's geometry, ``cblas_sgemm_compute``'s address, and
    ``ns`` (NULL, or two int64 counters the calls add their GEMM and elementwise time to)."""

    _fields_ = [("hidden", _I64), ("num_heads", _I64), ("num_kv_heads", _I64),
                ("head_dim", _I64), ("intermediate", _I64), ("eps", ctypes.c_float),
                ("gemm", _PTR), ("ns", _PTR)]


@functools.cache
def _lib() -> ctypes.CDLL | None:
    lib = load_cpu_library(SOURCE, CPU_FLAGS, LIBRARY, FALLBACK)
    if lib is None:
        return None
    shape, layer = ctypes.POINTER(LayerShape), ctypes.POINTER(DecoderLayerArgs)
    lib.vmkv_layer_attn_in.argtypes = [shape, layer, _PTR, _I64, _PTR, _PTR, _PTR, _PTR]
    lib.vmkv_layer_attn_out.argtypes = [shape, layer, _PTR, _I64, _PTR, _I64, _PTR, _PTR]
    lib.vmkv_layer_attn_in.restype = lib.vmkv_layer_attn_out.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the library builds and loads here (builds it on the first call)."""
    return _lib() is not None


def library() -> ctypes.CDLL:
    """The loaded library (RuntimeError when :func:`available` is False)."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("the CPU decoder-layer kernels are not available (see the log)")
    return lib
