"""Write a step's new K/V rows into a layer's flat cache view; negative rows are skipped.

    k_flat, v_flat: [rows, kv_heads, head_dim] (virtual: slot * slot_tokens + position;
                    paged: block * block_size + offset; any row and head strides)
    rows:           [T] int64, -1 = padding (a CUDA graph's padded batch entry): not written
    k, v:           [T, kv_heads, head_dim] (unit stride in head_dim)

On CUDA the write is one Triton kernel (one program per token, masked), which needs no host
sync and skips padding, so it can be captured in a CUDA graph. Elsewhere (CPU tests) it is
``index_copy_`` of the non-negative rows. Only the rows named are touched: the write never spans
the reserved range, so unmapped pages beyond each request's length are never accessed.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from vmkv.kernels.scaled_rows import FP8_DTYPES, SCALE_BYTES

logger = logging.getLogger(__name__)

StoreFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def store_index_copy(k_flat: torch.Tensor, v_flat: torch.Tensor, rows: torch.Tensor,
                     k: torch.Tensor, v: torch.Tensor) -> None:
    """``index_copy_`` of the rows ``>= 0`` (a host sync when padding is present: eager only)."""
    if rows.numel() and bool((rows < 0).any()):
        keep = rows >= 0
        rows, k, v = rows[keep], k[keep], v[keep]
    k_flat.index_copy_(0, rows, k)
    v_flat.index_copy_(0, rows, v)


def store_triton(k_flat: torch.Tensor, v_flat: torch.Tensor, rows: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor) -> None:
    """The masked Triton write (graph-capturable; CPU tensors only under TRITON_INTERPRET=1)."""
    from vmkv.attention.triton_store import store_kv

    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    fp8 = k_flat.dtype in FP8_DTYPES  # rows of D fp8 values + a 2-byte scale, quantized here
    row = (k.shape[1], k.shape[2] + SCALE_BYTES) if fp8 else tuple(k.shape[1:])
    for name, x in (("k_flat", k_flat), ("v_flat", v_flat)):
        if x.stride(-1) != 1 or tuple(x.shape[1:]) != row or (x.dtype != k.dtype and not fp8):
            raise ValueError(f"{name} {tuple(x.shape)} {x.dtype} (strides {x.stride()}) does "
                             f"not fit new rows {tuple(k.shape)} {k.dtype}")
    if rows.shape != (k.shape[0],):
        raise ValueError(f"rows must be [{k.shape[0]}], got {tuple(rows.shape)}")
    store_kv(k_flat, v_flat, rows, k, v)


def default_store(device: torch.device) -> tuple[StoreFn, bool]:
    """(store function, whether it is graph-capturable) for ``device``: the Triton write on
    CUDA when Triton can launch kernels there, else ``index_copy_`` (not capturable with
    padding)."""
    if device.type == "cuda" and triton_usable(device):
        return store_triton, True
    return store_index_copy, False


@functools.cache
def triton_usable(device: torch.device) -> bool:
    """Whether Triton kernels can run on ``device``.

    Off CUDA: whether the package imports (CPU tensors need ``TRITON_INTERPRET=1``). On CUDA an
    import proves little (Triton compiles its launcher with the host C compiler on first use,
    and the driver must accept it), so a one-element K/V write is launched and waited for; if
    it fails, one warning says why and callers take the torch paths (``index_copy_`` write,
    SDPA/gather attention, no CUDA graphs).
    """
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    if device.type != "cuda":
        return True
    try:
        one = torch.zeros(1, 1, 1, device=device)  # [T=1, H=1, D=1]
        cache = torch.zeros(1, 1, 1, device=device)
        store_triton(cache, cache.clone(), torch.zeros(1, dtype=torch.int64, device=device),
                     one, one)
        torch.cuda.synchronize(device)
    except Exception as exc:  # noqa: BLE001 - any failure means: do not use Triton here
        logger.warning("Triton is installed but cannot launch a kernel on %s (%s: %s); using "
                       "the torch paths instead (index_copy_ K/V write, SDPA/gather "
                       "attention, no CUDA graphs)", device, type(exc).__name__, exc)
        return False
    return True
