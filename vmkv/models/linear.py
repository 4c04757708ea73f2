"""CPU linear layers with weights packed once at load time: MKL's, oneDNN's or brgemm tiles.

    backend   dtype         weight at load                      per call
    mkl       float32       cblas_sgemm_pack (MKL's layout)     cblas_sgemm_compute, any rows
    brgemm    bfloat16      VNNI column blocks (cpu_bf16)       oneDNN's brgemm ukernel (AMX)
              float32       plain column blocks (cpu_bf16)      its float overload (AVX-512)
                            (decode's <= 64 rows, both dtypes: cpu_bf16's own streaming loops)
    onednn    either        mkldnn._reorder_linear_weight       mkldnn._linear_pointwise
    torch     either        as loaded                           F.linear (what transformers runs)

torch's default CPU ``F.linear`` repacks the weight inside every call. Packing once pays at
decode batch sizes: on the project's 2-core machines oneDNN's packed linear reached ~170-200
GFLOP/s where ``F.linear`` reached ~100-120 (AVX2), and MKL's packed compute beats oneDNN's by
1.1-2.5x at the decoder's shapes for 1-64 rows (AVX-512 Xeon, docs/benchmarks.md): it has no
per-call primitive set-up (~13 us for oneDNN) and its packed weight serves any row count.
MKL's ``cblas_sgemm_pack``/``cblas_sgemm_compute`` are reached through ctypes in torch's own
``libtorch_cpu`` (torch links MKL in on x86-64). In float32 ``auto`` takes MKL on Intel CPUs,
where it was measured; on other CPUs with AVX-512 the brgemm ukernel's float overload (an
AVX512-BF16 EPYC: ~110 GFLOP/s per core, and with the fused layers it enables 1.17x the
oneDNN + compiled-layer engine on a balanced mix, where MKL was 0.82x); elsewhere oneDNN, or
MKL where oneDNN is missing. All differ only by float reassociation (~1e-6 relative); ``mkl``
mostly matches ``F.linear`` bit for bit.

In bfloat16 ``auto`` takes ``brgemm`` where the CPU has bf16 hardware
(:mod:`vmkv.kernels.cpu_bf16`: oneDNN's AMX ukernel through torch, no per-call set-up, results
rounded once like ``F.linear``'s), else oneDNN where it packs bfloat16 (AVX-512 BW/VL/DQ or
AVX-NE-CONVERT), else ``F.linear`` (an AVX2-only CPU). A packed linear's output is
its input's dtype, except the LM head's (``out_dtype=float32``: logits are never rounded).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
from torch import nn

from vmkv.config import LINEAR_BACKENDS
from vmkv.cpu_info import cpu_features, cpu_vendor
from vmkv.kernels import cpu_bf16
from vmkv.models.huge_pages import huge_page_copies
from vmkv.models.quant.int8_head import Int8Head

logger = logging.getLogger(__name__)

# MKL's CBLAS enums (mkl_cblas.h)
_ROW_MAJOR, _NO_TRANS, _TRANS, _PACKED, _B_MATRIX = 101, 111, 112, 151, 162


@functools.cache
def _cblas() -> ctypes.CDLL | None:
    """torch's ``libtorch_cpu`` with MKL's packed-GEMM entry points typed, or None."""
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        get_size, pack, compute = (lib.cblas_sgemm_pack_get_size, lib.cblas_sgemm_pack,
                                   lib.cblas_sgemm_compute)
    except (OSError, AttributeError):
        return None
    c_int, c_ptr = ctypes.c_int, ctypes.c_void_p
    get_size.restype, get_size.argtypes = ctypes.c_size_t, [c_int] * 4
    pack.restype = None
    pack.argtypes = [c_int] * 6 + [ctypes.c_float, c_ptr, c_int, c_ptr]
    compute.restype = None
    compute.argtypes = [c_int] * 6 + [c_ptr, c_int, c_ptr, c_int, ctypes.c_float, c_ptr, c_int]
    return lib


def mkl_available() -> bool:
    """Whether torch exposes MKL's packed GEMM (``cblas_sgemm_pack``/``_compute``)."""
    return _cblas() is not None


def mkl_compute_address() -> int:
    """The address of MKL's ``cblas_sgemm_compute`` in torch's ``libtorch_cpu`` (for C code
    that calls it on weights packed here; RuntimeError when :func:`mkl_available` is False)."""
    lib = _cblas()
    if lib is None:
        raise RuntimeError("torch has no MKL packed GEMM (cblas_sgemm_compute)")
    address = ctypes.cast(lib.cblas_sgemm_compute, ctypes.c_void_p).value
    assert address is not None
    return address


def onednn_available() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


#: the x86 flag sets with which oneDNN packs a bfloat16 linear (its reorder refuses one without)
ONEDNN_BF16_FLAGS = (("avx512bw", "avx512vl", "avx512dq"), ("avx_ne_convert",))


def onednn_bf16_available() -> bool:
    """Whether oneDNN can pack a bfloat16 linear here: on x86 it needs AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT (an AVX2-only CPU runs bfloat16 linears through ``F.linear``)."""
    if not onednn_available():
        return False
    flags = set(cpu_features().split())
    x86 = "sse2" in flags
    return not x86 or any(set(group) <= flags for group in ONEDNN_BF16_FLAGS)


def _mkl_pack(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    """``weight [N, K]`` as MKL's packed ``B = weight^T`` (a byte buffer, 64-byte aligned)."""
    lib = _cblas()
    assert lib is not None  # PackedLinear checked mkl_available()
    weight = weight.contiguous()
    n, k = weight.shape
    size = lib.cblas_sgemm_pack_get_size(_B_MATRIX, batch_hint, n, k)
    packed = torch.empty(size, dtype=torch.uint8)
    lib.cblas_sgemm_pack(_ROW_MAJOR, _B_MATRIX, _TRANS, batch_hint, n, k, 1.0,
                         weight.data_ptr(), k, packed.data_ptr())
    return packed


def _mkl_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                out_features: int) -> torch.Tensor:
    # x: [M, K] -> [M, N]; the bias (if any) is C's starting value (beta = 1)
    m, k = x.shape
    if x.stride(1) != 1 or x.stride(0) < k:
        x = x.contiguous()
    if bias is None:
        out, beta = x.new_empty(m, out_features), 0.0
    else:
        out, beta = bias.repeat(m, 1), 1.0  # a new tensor (contiguous() may alias)
    if m > 0:
        _cblas().cblas_sgemm_compute(  # type: ignore[union-attr]
            _ROW_MAJOR, _NO_TRANS, _PACKED, m, out_features, k, x.data_ptr(), x.stride(0),
            packed.data_ptr(), k, beta, out.data_ptr(), out_features)
    return out


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                   out_features: int) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


_GEMMS = {"mkl": _mkl_linear, "onednn": _onednn_linear}
#: the backends each dtype can pack for
PACKED_BACKENDS = {torch.float32: ("mkl", "brgemm", "onednn"),
                   torch.bfloat16: ("brgemm", "onednn")}


def packed_gemm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                out_features: int, backend: str) -> torch.Tensor:
    """``x [M, K] -> x W^T + b [M, out_features]`` with ``W`` packed for ``backend`` (mkl or
    onednn; brgemm weights are called through :class:`PackedLinear`)."""
    return _GEMMS[backend](x, packed, bias, out_features)


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` packed once for ``backend`` (inference only): float32 for
    mkl, bfloat16 for brgemm, either for onednn. ``out_dtype``: the result's dtype (default the
    weight's; the brgemm backend can also give float32, for the LM head). ``parts``: the
    outputs are that many equal parts each starting on a packed block (brgemm; gate|up: 2)."""

    def __init__(self, linear: nn.Linear, batch_hint: int, backend: str,
                 out_dtype: torch.dtype | None = None, parts: int = 1) -> None:
        super().__init__()
        dtype = linear.weight.dtype
        backend = resolve_backend(backend, dtype)  # "auto" picks; one this torch lacks: refused
        if backend not in PACKED_BACKENDS.get(dtype, ()):
            raise ValueError(f"PackedLinear backend must be one of "
                             f"{PACKED_BACKENDS.get(dtype, ())} for {dtype}, got {backend!r}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.backend = backend
        self.out_dtype = out_dtype or dtype
        if self.out_dtype != dtype and backend != "brgemm":
            raise ValueError(f"only the brgemm backend gives {self.out_dtype} from {dtype}")
        weight = linear.weight.detach()
        if backend == "brgemm":
            packed = cpu_bf16.pack_weight(weight, cpu_bf16.block_n(self.out_features, parts))
        elif backend == "mkl":
            packed = _mkl_pack(weight, batch_hint)
        else:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        self.register_buffer("packed_weight", packed, persistent=False)
        bias = linear.bias.detach() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)
        self._brgemm = None  # (LinearArgs, GemmArgs), built on first use (buffers final)

    def brgemm_args(self) -> cpu_bf16.LinearArgs:
        """The C view of this brgemm-packed weight (for the fused layers' calls)."""
        return cpu_bf16.linear_args(self.packed_weight, self.bias, self.in_features,
                                    self.out_features)

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x [T, in_features]`` -> ``[T, out_features]``; the brgemm backend writes into
        ``out`` when given (see :func:`vmkv.kernels.cpu_bf16.linear`), the others ignore it."""
        if torch.compiler.is_compiling():  # opaque to Inductor: the packed call as it is
            return torch.ops.vmkv.packed_linear(x, self.packed_weight, self.bias,
                                                self.out_features, self.backend)
        if self.backend == "brgemm":
            if self._brgemm is None:
                self._brgemm = (self.brgemm_args(),
                                cpu_bf16.gemm_args(dtype=self.packed_weight.dtype))
            return cpu_bf16.linear(x, *self._brgemm, self.out_dtype, out)
        return packed_gemm(x, self.packed_weight, self.bias, self.out_features, self.backend)


@torch.library.custom_op("vmkv::packed_linear", mutates_args=())
def _packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                   out_features: int, backend: str) -> torch.Tensor:
    """:func:`packed_gemm` for compiled code (Inductor has no lowering for a weight packed
    outside it)."""
    if backend == "brgemm":
        k = cpu_bf16.packed_in_features(packed_weight)
        args = cpu_bf16.linear_args(packed_weight, bias, k, out_features)
        return cpu_bf16.linear(x, args, cpu_bf16.gemm_args(dtype=x.dtype), x.dtype)
    return packed_gemm(x, packed_weight, bias, out_features, backend)


@_packed_linear.register_fake
def _packed_linear_shape(x: torch.Tensor, packed_weight: torch.Tensor,
                         bias: torch.Tensor | None, out_features: int, backend: str
                         ) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


def resolve_backend(backend: str, dtype: torch.dtype = torch.float32) -> str:
    """The packed backend ``backend`` means for ``dtype`` linears here ("torch" for none).
    Raises ValueError for an unknown name or an explicit backend this torch, CPU or dtype
    lacks."""
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {backend!r}")
    if dtype == torch.bfloat16:
        return _resolve_bf16(backend)
    if backend == "auto":  # each measured fastest where it is taken (the docstring above)
        if mkl_available() and cpu_vendor() == "GenuineIntel":
            return "mkl"
        if cpu_bf16.available(torch.float32):
            return "brgemm"
        if mkl_available() and not onednn_available():
            return "mkl"
        return "onednn" if onednn_available() else "torch"
    if backend == "mkl" and not mkl_available():
        raise ValueError("linear_backend='mkl' needs torch built with MKL "
                         "(cblas_sgemm_pack in libtorch_cpu)")
    if backend == "onednn" and not onednn_available():
        raise ValueError("linear_backend='onednn' needs torch built with oneDNN (mkldnn)")
    if backend == "brgemm" and not cpu_bf16.available(torch.float32):
        raise ValueError(f"linear_backend='brgemm' cannot run float32 here: "
                         f"{cpu_bf16.unavailable_reason(torch.float32)}")
    return backend


def _resolve_bf16(backend: str) -> str:
    if backend == "auto":
        if cpu_bf16.available():
            return "brgemm"
        return "onednn" if onednn_bf16_available() else "torch"
    if backend == "mkl":
        raise ValueError("linear_backend='mkl' is float32 only (MKL's packed sgemm); bfloat16 "
                         "takes brgemm, onednn or torch")
    if backend == "brgemm" and not cpu_bf16.available():
        raise ValueError(f"linear_backend='brgemm' cannot run here: "
                         f"{cpu_bf16.unavailable_reason()}")
    if backend == "onednn" and not onednn_bf16_available():
        raise ValueError("linear_backend='onednn' cannot pack bfloat16 here: it needs torch "
                         "built with oneDNN (mkldnn) and, on x86, AVX-512 BW/VL/DQ or "
                         "AVX-NE-CONVERT; choose torch")
    return backend


def writes_float32_into(linear: nn.Module) -> bool:
    """Whether ``linear(x, out=buffer)`` writes its float32 result into ``buffer``: a brgemm
    :class:`PackedLinear` with float32 output (the LM head's), or the int8 LM head."""
    if isinstance(linear, Int8Head):
        return True
    return (isinstance(linear, PackedLinear) and linear.backend == "brgemm"
            and linear.out_dtype == torch.float32)


def pack_linears(model: nn.Module, backend: str = "auto", batch_hint: int = 64) -> int:
    """Swap ``model``'s float32 or bfloat16 CPU ``nn.Linear`` layers for
    :class:`PackedLinear`; returns how many were swapped (0 for other devices/dtypes or where
    ``backend`` resolves to "torch"). The one named ``lm_head`` gives float32 logits when its
    backend can (brgemm)."""
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {backend!r}")
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not (isinstance(child, nn.Linear) and child.weight.device.type == "cpu"
                    and child.weight.dtype in PACKED_BACKENDS):
                continue
            chosen = resolve_backend(backend, child.weight.dtype)
            if chosen == "torch":
                continue
            out = torch.float32 if name == "lm_head" and chosen == "brgemm" else None
            parts = 2 if name == "gate_up_proj" else 1  # the MLP's gate and up, fused
            setattr(parent, name, PackedLinear(child, batch_hint, chosen, out, parts))
            swapped += 1
    logger.debug("packed %d linear layers for %s", swapped, backend)
    _into_huge_pages([m for m in model.modules() if isinstance(m, PackedLinear)])
    return swapped


def _into_huge_pages(linears: list[PackedLinear]) -> None:
    """Move the brgemm weights (plain column blocks) into 2 MiB pages
    (:mod:`vmkv.models.huge_pages`), before anything holds their addresses. MKL's packed
    buffers are opaque (a copy of one crashed ``cblas_sgemm_compute``) and oneDNN's have their
    own layout: both stay where they were packed."""
    movable = [lin for lin in linears if lin.backend == "brgemm"]
    copies = huge_page_copies([lin.packed_weight for lin in movable]) if movable else None
    for lin, copy in zip(movable, copies or (), strict=False):
        lin.packed_weight = copy
