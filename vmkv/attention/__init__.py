"""Attention backends, chosen by KV mode and device (see :func:`create_attention_backend`)."""

from __future__ import annotations

from vmkv.attention.base import AttentionBackend, AttentionMetadata
from vmkv.kv.base import KVCacheManager

__all__ = ["AttentionBackend", "AttentionMetadata", "create_attention_backend"]


def create_attention_backend(kv: KVCacheManager) -> AttentionBackend:
    """The backend for ``kv``'s mode on ``kv``'s device."""
    from vmkv.kv.paged import PagedKVCache
    from vmkv.kv.virtual import VirtualKVCache

    if kv.device.type == "cpu":
        if isinstance(kv, VirtualKVCache):
            from vmkv.attention.virtual_cpu import VirtualSdpaBackend

            return VirtualSdpaBackend(kv)
        if isinstance(kv, PagedKVCache):
            from vmkv.attention.paged_cpu import PagedGatherBackend

            return PagedGatherBackend(kv)
    raise ValueError(f"no attention backend for kv_mode={kv.kv_mode!r} on {kv.device}")
