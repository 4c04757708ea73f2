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

from collections.abc import Callable

import torch

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
    for name, x in (("k_flat", k_flat), ("v_flat", v_flat)):
        if x.stride(-1) != 1 or x.shape[1:] != k.shape[1:] or x.dtype != k.dtype:
            raise ValueError(f"{name} {tuple(x.shape)} {x.dtype} (strides {x.stride()}) does "
                             f"not fit new rows {tuple(k.shape)} {k.dtype}")
    if rows.shape != (k.shape[0],):
        raise ValueError(f"rows must be [{k.shape[0]}], got {tuple(rows.shape)}")
    store_kv(k_flat, v_flat, rows, k, v)


def default_store(device: torch.device) -> tuple[StoreFn, bool]:
    """(store function, whether it is graph-capturable) for ``device``: the Triton write on
    CUDA when Triton imports, else ``index_copy_`` (not capturable with padding)."""
    if device.type == "cuda" and has_triton():
        return store_triton, True
    return store_index_copy, False


def has_triton() -> bool:
    """Whether the ``triton`` package imports."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
