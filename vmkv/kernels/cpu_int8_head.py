"""The int8 LM head's kernel (``csrc/cpu_int8_head.cpp``): logits from u8 x s8 products on
oneDNN's brgemm ukernel (torch's export), each row's leading candidates rescored exactly.

    pack(weight)          W [N, K] -> int8 per row, packed [blocks][K / 4][64][4] (VNNI quads),
                          its u8-offset corrections and row scales
    head(x, args, out)    out [m, N] float32 = the logits of x [m, K] (float32 or bfloat16)

Measured on a 2-core Zen 4 EPYC (AVX512-VNNI, no AMX): Gemma 3's head (262,144 x 640) at 64
rows takes ~28 ms in u8 x s8 against ~53 ms in bf16 on the same ukernel.

Runs where the CPU multiplies u8 x s8 without saturating (AVX512-VNNI or AMX-INT8) and torch
exports the ukernel's int8 overload; :func:`unavailable_reason` says why not elsewhere.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from vmkv.cpu_info import cpu_features
from vmkv.kernels import cpu_bf16
from vmkv.kernels.build import CPU_FLAGS, CSRC, load_cpu_library

SOURCE = CSRC / "cpu_int8_head.cpp"
LIBRARY = "vmkv_cpu_int8_head"
FALLBACK = "no int8 LM head (--lm-head-dtype int8 is refused)"
#: output columns per packed block
BLOCK_N = 64
#: the CPU flags under which the ukernel's u8 x s8 products do not saturate
INT8_FLAGS = ("avx512_vnni", "amx_int8")
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


class HeadArgs(ctypes.Structure):
    """``VmkvInt8Head`` of the C source."""

    _fields_ = [("packed", _PTR), ("comp", _PTR), ("scale", _PTR), ("dense", _PTR),
                ("dense_stride", _I64), ("dense_bf16", ctypes.c_int), ("in_features", _I64),
                ("out_features", _I64), ("block_n", _I64), ("brgemm", _PTR), ("release", _PTR)]


@dataclass(frozen=True)
class PackedHead:
    """A head quantized per row to int8: ``packed`` int8 ``[blocks, K / 4, BLOCK_N, 4]``,
    ``comp`` int32 and ``scale`` float32 ``[blocks * BLOCK_N]`` (zero past N)."""

    packed: torch.Tensor
    comp: torch.Tensor
    scale: torch.Tensor
    out_features: int
    in_features: int


def pack(weight: torch.Tensor) -> PackedHead:
    """``weight [N, K]`` (K a multiple of 4) quantized per row, ``q = round(w / s)`` in
    [-127, 127] with ``s = max|w| / 127``, and packed for the ukernel."""
    n, k = weight.shape
    if k % 4:
        raise ValueError(f"the int8 LM head needs hidden size divisible by 4, got {k}")
    w = weight.detach().to(torch.float32)
    scale = w.abs().amax(dim=1) / 127  # [N]
    codes = torch.round(w / torch.where(scale > 0, scale, 1)[:, None]).clamp(-127, 127)
    blocks = -(-n // BLOCK_N)
    padded = torch.zeros(blocks * BLOCK_N, k, dtype=torch.int8)
    padded[:n] = codes.to(torch.int8)
    packed = padded.view(blocks, BLOCK_N, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    comp = padded.sum(dim=1, dtype=torch.int32) * 128  # [blocks * BLOCK_N]
    full_scale = torch.zeros(blocks * BLOCK_N, dtype=torch.float32)
    full_scale[:n] = scale
    return PackedHead(packed, comp, full_scale, n, k)


@functools.cache
def _lib() -> ctypes.CDLL | None:
    lib = load_cpu_library(SOURCE, CPU_FLAGS, LIBRARY, FALLBACK)
    if lib is None:
        return None
    lib.vmkv_int8_head.argtypes = [ctypes.POINTER(HeadArgs), _PTR, _I64, ctypes.c_int, _I64,
                                   _PTR, _I64, _I64]
    lib.vmkv_int8_head.restype = ctypes.c_int
    return lib


@functools.cache
def unavailable_reason() -> str | None:
    """Why the int8 head cannot run here (None when it can; builds the library)."""
    flags = set(cpu_features().split())
    if not flags & set(INT8_FLAGS):
        return (f"this CPU has neither of {', '.join(INT8_FLAGS)} (u8 x s8 products without "
                f"saturation)")
    if not torch.backends.mkldnn.is_available() or cpu_bf16.ukernel(torch.uint8) is None:
        return "this torch does not export oneDNN's int8 brgemm ukernel (at::native::cpublas)"
    if _lib() is None:
        return "the int8 head's kernel library did not build (see the log)"
    return None


def head_args(head: PackedHead, dense: torch.Tensor) -> HeadArgs:
    """The C view of ``head`` with ``dense [N, K]`` (float32 or bfloat16, unit column stride)
    the rows its candidates are rescored from; the caller keeps the tensors alive."""
    if dense.shape != (head.out_features, head.in_features) or dense.stride(1) != 1:
        raise ValueError(f"dense rows {tuple(dense.shape)} (strides {dense.stride()}) do not "
                         f"match the int8 head [{head.out_features}, {head.in_features}]")
    if dense.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the int8 head rescores from float32 or bfloat16 rows, got {dense.dtype}")
    ukernel = cpu_bf16.ukernel(torch.uint8)
    if ukernel is None:
        raise ValueError(unavailable_reason() or "no int8 brgemm ukernel")
    return HeadArgs(head.packed.data_ptr(), head.comp.data_ptr(), head.scale.data_ptr(),
                    dense.data_ptr(), dense.stride(0), int(dense.dtype == torch.bfloat16),
                    head.in_features, head.out_features, BLOCK_N, ukernel[0], ukernel[1])


def head(x: torch.Tensor, args: HeadArgs, out: torch.Tensor, candidates: int) -> torch.Tensor:
    """``out [m, N]`` float32 <- the logits of ``x [m, K]`` (float32 or bfloat16 rows, unit column
    stride), each row's ``candidates`` (0-64) largest rescored from the dense rows."""
    lib = _lib()
    if lib is None:
        raise ValueError(unavailable_reason() or "the int8 head's library did not load")
    if (x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16) or x.stride(1) != 1
            or out.dtype != torch.float32 or out.dim() != 2 or out.stride(1) != 1
            or out.shape != (x.shape[0], args.out_features) or x.shape[1] != args.in_features):
        raise ValueError(f"the int8 head takes x [m, {args.in_features}] float32/bfloat16 into "
                         f"out [m, {args.out_features}] float32, got {tuple(x.shape)} {x.dtype} "
                         f"and {tuple(out.shape)} {out.dtype}")
    rc = lib.vmkv_int8_head(ctypes.byref(args), x.data_ptr(), x.stride(0),
                            int(x.dtype == torch.bfloat16), x.shape[0], out.data_ptr(),
                            out.stride(0), candidates)
    if rc:
        why = "bad arguments" if rc == 1 else "the ukernel raised"
        raise ValueError(f"the int8 head kernel failed ({why}): x {tuple(x.shape)}, "
                         f"{candidates} candidates")
    return out
