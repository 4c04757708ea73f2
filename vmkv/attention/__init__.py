"""Attention backends, chosen by KV mode and device (see :func:`create_attention_backend`)."""

from __future__ import annotations

from vmkv.attention.base import AttentionBackend, AttentionMetadata
from vmkv.kv.base import KVCacheManager

__all__ = ["AttentionBackend", "AttentionMetadata", "create_attention_backend"]


def create_attention_backend(kv: KVCacheManager, kernel: str | None = None) -> AttentionBackend:
    """The backend for ``kv``'s mode on ``kv``'s device.

    CPU: SDPA on slot views (virtual) or a block-table gather (paged). CUDA: FlashAttention-2
    on the slot views (virtual) or the paged Triton twin / flash-attn block tables (paged).
    ``kernel`` (CUDA only; default ``$VMKV_ATTENTION_BACKEND`` or "auto") picks the CUDA kernel:
    "auto", "flash", "flash-attn", "aten-flash", "triton", "sdpa" (see
    :mod:`vmkv.attention.cuda_common`).
    """
    from vmkv.kv.paged import PagedKVCache
    from vmkv.kv.virtual import VirtualKVCache

    if kv.device.type == "cpu":
        if kernel is not None:
            raise ValueError(f"kernel={kernel!r} selects a CUDA attention kernel; the KV cache "
                             "is on the CPU")
        if isinstance(kv, VirtualKVCache):
            from vmkv.attention.virtual_cpu import VirtualSdpaBackend

            return VirtualSdpaBackend(kv)
        if isinstance(kv, PagedKVCache):
            from vmkv.attention.paged_cpu import PagedGatherBackend

            return PagedGatherBackend(kv)
    if kv.device.type == "cuda":
        if isinstance(kv, VirtualKVCache):
            from vmkv.attention.virtual_cuda import VirtualCudaBackend

            return VirtualCudaBackend(kv, kernel)
        if isinstance(kv, PagedKVCache):
            from vmkv.attention.paged_cuda import PagedCudaBackend

            return PagedCudaBackend(kv, kernel)
    raise ValueError(f"no attention backend for kv_mode={kv.kv_mode!r} on {kv.device}")
