"""Which CUDA attention kernel a KV cache runs with (``kernel=``: an engine passes its
``EngineConfig.attention_backend``, whose default is ``$VMKV_ATTENTION_BACKEND``).

    auto        best available: flash-attn > triton > aten-flash > sdpa (virtual);
                flash-attn (block size % 256 == 0) > triton > sdpa (paged). Triton ranks
                above aten-flash, which has no split-KV decode (the measurements:
                docs/gpu-results.md)
    flash       flash-attn if installed, else aten-flash (virtual) / triton (paged)
    flash-attn  the flash_attn package: flash_attn_with_kvcache (slot ids or block table)
    aten-flash  torch.ops.aten._flash_attention_forward, varlen + seqused_k (virtual only)
    triton      vmkv.kernels.triton_decode twins (decode kernel for decode-only batches,
                prefill twin otherwise)
    sdpa        torch SDPA per request

One policy for both modes: what the deployment decides (a missing package, the block size, the
number of slots) makes an explicitly requested kernel raise ValueError; what the model fixes
(its dtype, its head size) makes FlashAttention fall back to SDPA with a warning. "auto" never
raises: float32 caches use SDPA (exact fp32, like the transformers reference), odd head sizes
the Triton twin.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import torch

from vmkv.config import ATTENTION_BACKENDS
from vmkv.kernels.scaled_rows import FP8_DTYPES

logger = logging.getLogger(__name__)

KERNELS = ATTENTION_BACKENDS
FLASH_DTYPES = (torch.float16, torch.bfloat16)
#: keyword arguments of aten._flash_attention_forward this code passes (present in 2.11+)
ATEN_REQUIRED_KWARGS = frozenset({"scale", "seqused_k"})
FLASH_PAGED_BLOCK = 256  # FA2's paged KV needs block_size % 256 == 0


def requested_kernel(kernel: str | None) -> str:
    """``kernel``, or "auto" when None; ValueError for unknown names. (The environment's
    choice reaches here only through ``EngineConfig.attention_backend``.)"""
    name = kernel or "auto"
    if name not in KERNELS:
        raise ValueError(f"attention kernel must be one of {KERNELS}, got {name!r}")
    return name


@functools.cache
def flash_attn_module() -> ModuleType | None:
    """The ``flash_attn`` package if it imports (it is absent on the H200 machine)."""
    try:
        import flash_attn
    except Exception:  # ImportError, or a broken CUDA extension
        return None
    return flash_attn if hasattr(flash_attn, "flash_attn_with_kvcache") else None


@functools.cache
def aten_flash_kwargs() -> frozenset[str]:
    """Keyword-only arguments of ``aten._flash_attention_forward`` in this torch build.

    torch 2.11: scale, window_size_left, window_size_right, seqused_k, alibi_slopes;
    torch 2.13 adds block_table, num_splits. Empty if the op does not exist.
    """
    try:
        schema = torch.ops.aten._flash_attention_forward.default._schema
    except (AttributeError, RuntimeError):
        return frozenset()
    return frozenset(a.name for a in schema.arguments if a.kwarg_only)


def flash_unsupported(dtype: torch.dtype, head_dim: int) -> str | None:
    """Why FlashAttention-2 cannot run this cache (None if it can).

    FA2 takes fp16/bf16 only, and head sizes that are multiples of 8 up to 256 (older builds
    pad other sizes by copying the whole K/V tensor, which would touch unmapped pages).
    """
    if dtype not in FLASH_DTYPES:
        return f"FlashAttention-2 supports float16/bfloat16 only, not {dtype}"
    if head_dim % 8 or head_dim > 256:
        return f"FlashAttention-2 needs head_dim % 8 == 0 and <= 256, got {head_dim}"
    return None




def resolve_kernel(requested: str, *, paged: bool, dtype: torch.dtype, head_dim: int,
                   block_size: int, flash_attn: bool, aten: bool, triton: bool,
                   rows_fit_int32: bool) -> str:
    """The kernel a cache runs with (warns on a fallback; see the module's policy).

    Args:
        requested: a name of :data:`KERNELS`.
        paged: block-table addressing (else virtual slots).
        block_size: tokens per block (paged mode; ignored otherwise).
        flash_attn, aten, triton: whether the flash_attn package, torch's aten varlen op with
            ``seqused_k``, and launchable Triton exist here.
        rows_fit_int32: whether the cache's flat rows fit FlashAttention's int32 offsets.
    """
    name = "paged-cuda" if paged else "virtual-cuda"
    if dtype in FP8_DTYPES:  # scaled fp8 rows: only the Triton twins read them
        if requested not in ("auto", "triton"):
            raise ValueError(f"{name}: an fp8 KV cache is read by the Triton twins only, not "
                             f"by {requested!r}")
        if not triton:
            raise ValueError(f"{name}: an fp8 KV cache needs Triton, which cannot launch "
                             "kernels here")
        return "triton"
    model_reason = flash_unsupported(dtype, head_dim)
    cache_reason = None
    if paged and block_size % FLASH_PAGED_BLOCK:
        cache_reason = (f"FlashAttention-2's paged kernels need block_size % "
                        f"{FLASH_PAGED_BLOCK} == 0, got {block_size}")
    if paged:
        aten_reason: str | None = ("aten._flash_attention_forward has no block table in this "
                                   "torch; use 'triton' or 'flash-attn'")
    elif not aten:
        aten_reason = ("torch's aten._flash_attention_forward with "
                       f"{sorted(ATEN_REQUIRED_KWARGS)} is unavailable here")
    elif not rows_fit_int32:
        aten_reason = "num_slots * slot_tokens must be < 2**31 (FlashAttention's int32 offsets)"
    else:
        aten_reason = None
    if requested == "flash":
        requested = "flash-attn" if flash_attn else "triton" if paged else "aten-flash"
    if requested == "auto":
        if flash_attn and model_reason is None and cache_reason is None:
            return "flash-attn"
        if triton and dtype != torch.float32:
            return "triton"  # both modes' own kernel after flash-attn
        if model_reason is None and aten_reason is None:
            warn_fallback(name, "Triton cannot launch kernels here", "aten-flash")
            return "aten-flash"
        if dtype == torch.float32:
            why = model_reason or ""
        else:
            why = "; ".join(r for r in (None if paged else aten_reason,
                                        "Triton cannot launch kernels here") if r)
        warn_fallback(name, why, "sdpa")
        return "sdpa"
    if requested == "flash-attn":
        if not flash_attn:
            raise ValueError(f"{name}: kernel 'flash-attn' needs the flash_attn package")
        if cache_reason is not None:
            raise ValueError(f"{name}: kernel 'flash-attn': {cache_reason}")
    if requested == "aten-flash" and aten_reason is not None:
        raise ValueError(f"{name}: kernel 'aten-flash': {aten_reason}")
    if requested == "triton" and not triton:
        raise ValueError(f"{name}: kernel 'triton' needs Triton able to launch kernels here "
                         "(not installed, or its launch failed: see the warning)")
    if requested in ("flash-attn", "aten-flash") and model_reason is not None:
        warn_fallback(name, model_reason, "sdpa")
        return "sdpa"
    return requested


def warn_fallback(backend: str, reason: str, fallback: str) -> None:
    logger.warning("%s: %s; using the %s kernel instead", backend, reason, fallback)
