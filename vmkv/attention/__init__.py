"""Attention backends: one per device, over either KV mode (see :func:`create_attention_backend`).

The KV manager hands each step's addressing (slot ids or a block table, :mod:`vmkv.kv.addressing`)
to the backend of its device; neither backend looks at the manager's class.
"""

from __future__ import annotations

from collections.abc import Callable

from vmkv.attention.base import AttentionBackend, AttentionMetadata
from vmkv.kv.base import KVCacheManager

__all__ = ["AttentionBackend", "AttentionMetadata", "create_attention_backend"]


def _cpu(kv: KVCacheManager, kernel: str | None) -> AttentionBackend:
    if kernel not in (None, "auto"):
        raise ValueError(f"kernel={kernel!r} selects a CUDA attention kernel; the KV cache is "
                         "on the CPU")
    from vmkv.attention.cpu import CpuAttentionBackend

    return CpuAttentionBackend(kv)


def _cuda(kv: KVCacheManager, kernel: str | None) -> AttentionBackend:
    from vmkv.attention.cuda import CudaAttentionBackend

    return CudaAttentionBackend(kv, kernel)


#: device type -> backend factory (imports are lazy: Triton and CUDA only where used)
BACKENDS: dict[str, Callable[[KVCacheManager, str | None], AttentionBackend]] = {
    "cpu": _cpu,
    "cuda": _cuda,
}


def create_attention_backend(kv: KVCacheManager, kernel: str | None = None) -> AttentionBackend:
    """The backend for ``kv``'s device, over ``kv``'s mode.

    CPU: a batched in-place decode kernel and SDPA. CUDA: flash-attn, else the Triton twins
    (contiguous slots for virtual, block tables for paged), else FlashAttention-2 (aten) on
    the slot views (virtual). ``kernel`` (CUDA only;
    default ``$VMKV_ATTENTION_BACKEND`` or "auto") picks the CUDA kernel: "auto", "flash",
    "flash-attn", "aten-flash", "triton", "sdpa" (see :mod:`vmkv.attention.kernel_choice`).
    """
    factory = BACKENDS.get(kv.device.type)
    if factory is None:
        raise ValueError(f"no attention backend for kv_mode={kv.kv_mode!r} on {kv.device}")
    return factory(kv, kernel)
