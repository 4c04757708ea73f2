"""CUDA C++ twins (``csrc/paged_attention.cu``): PagedAttention-style decode, contiguous vs paged.

Build and load: :func:`build_and_load` runs ``nvcc -shared`` on the source once per source hash
and arch (cached under ``$VMKV_BUILD_DIR``, default ``~/.cache/vmkv/csrc``) and opens the result
with :mod:`ctypes`. The library has a plain C ABI (raw pointers, int64 strides, the stream as an
integer) and links no torch, so it does not depend on the torch version or its C++ ABI; nvcc's
default static cudart shares the device's primary context with torch.

The wrappers mirror :mod:`vmkv.kernels.triton_decode` (same shapes and contracts). This module
imports anywhere; calling a wrapper without CUDA raises :class:`RuntimeError`.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
from pathlib import Path

import torch

from vmkv import envs
from vmkv.kernels.build import CSRC, build_shared_library

__all__ = ["SOURCE", "build_and_load", "decode_contiguous", "decode_paged"]

SOURCE = CSRC / "paged_attention.cu"
NVCC_FLAGS = ("-std=c++17", "-O3", "-shared", "-Xcompiler", "-fPIC")
HEAD_SIZES = (64, 128, 256)
_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_U64, _I64 = ctypes.c_uint64, ctypes.c_int64
_ARGTYPES = (
    [ctypes.c_int, ctypes.c_int]  # dtype, paged
    + [_U64] * 9  # out, q, k, v, index, seq_lens, tmp_out, exp_sums, max_logits
    + [_I64] * 6  # num_seqs, num_heads, num_kv_heads, head_size, block_size, max_seq_len
    + [ctypes.c_float]  # scale
    + [_I64] * 11  # q(2), out(2), k(3), v(3) strides, block-table row stride
    + [_U64]  # stream
)


def _default_arch() -> str:
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"sm_{major}{minor}"
    return "sm_90"


def build_and_load(arch: str | None = None, build_dir: str | Path | None = None,
                   verbose: bool = False) -> ctypes.CDLL:
    """Compile ``csrc/paged_attention.cu`` for ``arch`` (default: this GPU, else sm_90) if no
    cached build exists, and load it. Raises RuntimeError when nvcc is missing or fails."""
    arch = arch or _default_arch()
    nvcc = shutil.which("nvcc") or os.path.join(envs.cuda_home(),
                                                "bin", "nvcc")
    if not os.path.exists(nvcc):
        raise RuntimeError("nvcc not found (PATH or $CUDA_HOME/bin): cannot build the CUDA twins")
    flags = (*NVCC_FLAGS, f"-arch={arch}")
    lib_path = build_shared_library(SOURCE, nvcc, flags, f"vmkv_paged_attention_{arch}",
                                    build_dir, verbose)
    lib = ctypes.CDLL(str(lib_path))
    lib.vmkv_decode_attention.argtypes = _ARGTYPES
    lib.vmkv_decode_attention.restype = ctypes.c_int
    lib.vmkv_error_string.argtypes = [ctypes.c_int]
    lib.vmkv_error_string.restype = ctypes.c_char_p
    lib.vmkv_decode_partition_size.restype = ctypes.c_int
    return lib


@functools.cache
def _lib() -> ctypes.CDLL:
    return build_and_load()


def _decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor,
            seq_lens: torch.Tensor, scale: float, max_seq_len: int | None, *, paged: bool
            ) -> torch.Tensor:
    if not torch.cuda.is_available() or q.device.type != "cuda":
        raise RuntimeError(f"the CUDA twins need CUDA tensors on a GPU machine, got {q.device} "
                           f"(torch.cuda.is_available()={torch.cuda.is_available()})")
    if q.dim() != 3 or k.dim() != 4 or v.shape != k.shape or q.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"want q [B, Hq, D], k/v 4-D alike, seq_lens [B]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}, {tuple(seq_lens.shape)}")
    batch, num_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q/k/v must share one of {list(_DTYPES)}: {q.dtype} {k.dtype} {v.dtype}")
    if head_dim not in HEAD_SIZES or k.shape[3] != head_dim or num_heads % kv_heads:
        raise ValueError(f"head_dim must be one of {HEAD_SIZES} and heads {num_heads} a multiple "
                         f"of kv heads; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if any(x.stride(-1) != 1 for x in (q, k, v)):
        raise ValueError("q, k and v need unit stride in head_dim")
    for name, x in (("index", index), ("seq_lens", seq_lens)):
        if x.dtype != torch.int32 or x.device != q.device or x.stride(-1) != 1:
            raise ValueError(f"{name} must be int32 on {q.device} with unit last stride")
    lib = _lib()
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max()) if batch else 0  # NOTE: a host sync; pass it when known
    parts = max(1, -(-max_seq_len // lib.vmkv_decode_partition_size()))
    out = torch.empty_like(q)  # [B, Hq, D]
    if parts > 1:
        tmp_out = torch.empty(batch, num_heads, parts, head_dim, dtype=torch.float32,
                              device=q.device)
        stats = torch.empty(2, batch, num_heads, parts, dtype=torch.float32, device=q.device)
        workspace = (tmp_out.data_ptr(), stats[0].data_ptr(), stats[1].data_ptr())
    else:
        workspace = (0, 0, 0)
    with torch.cuda.device(q.device):
        stream = torch.cuda.current_stream(q.device).cuda_stream
        err = lib.vmkv_decode_attention(
            _DTYPES[q.dtype], int(paged), out.data_ptr(), q.data_ptr(), k.data_ptr(),
            v.data_ptr(), index.data_ptr(), seq_lens.data_ptr(), *workspace,
            batch, num_heads, kv_heads, head_dim, k.shape[1] if paged else 1, max_seq_len,
            float(scale), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
            index.stride(0) if paged else 0, stream,
        )
    if err != 0:
        raise RuntimeError(f"vmkv_decode_attention: {lib.vmkv_error_string(err).decode()}")
    return out


def decode_contiguous(q: torch.Tensor, k_view: torch.Tensor, v_view: torch.Tensor,
                      slot_ids: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                      max_seq_len: int | None = None) -> torch.Tensor:
    """Decode attention over virtually contiguous slots; contract of
    :func:`vmkv.kernels.triton_decode.decode_contiguous` (``k_view, v_view [num_slots,
    slot_tokens, Hkv, D]`` strided, ``slot_ids``/``seq_lens [B]`` int32, returns ``[B, Hq, D]``).

    ``max_seq_len`` (>= every ``seq_lens[b]``) sizes the partitions; None reads it from
    ``seq_lens`` with a host sync. D must be 64, 128 or 256; K/V rows 16-byte aligned.
    """
    return _decode(q, k_view, v_view, slot_ids, seq_lens, scale, max_seq_len, paged=False)


def decode_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                 max_seq_len: int | None = None) -> torch.Tensor:
    """Decode attention through a block table; contract of
    :func:`vmkv.kernels.triton_decode.decode_paged` (``k_cache, v_cache [num_blocks, block_size,
    Hkv, D]``, ``block_table [B, max_blocks]`` int32). ``max_seq_len`` as in
    :func:`decode_contiguous`.
    """
    return _decode(q, k_cache, v_cache, block_table, seq_lens, scale, max_seq_len, paged=True)
