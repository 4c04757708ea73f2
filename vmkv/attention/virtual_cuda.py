"""Virtual mode on CUDA: unmodified FlashAttention-2 over the slot views (vAttention's point).

Each layer's K (and V) is a strided view ``[num_slots, slot_tokens, Hkv, D]`` of the reserved
range; flattened it is ``[num_slots * slot_tokens, Hkv, D]`` and request b's keys are rows
``slot_b * slot_tokens ..``. FlashAttention's varlen mode addresses exactly that:

    aten._flash_attention_forward(q [T, Hq, D], k_flat, v_flat,
        cum_seq_q [B+1]  = 0, q_0, q_0+q_1, ...          (packed new tokens)
        cum_seq_k [B+1]  = slot_b * slot_tokens            (need not be monotonic)
        seqused_k [B]    = context_b + q_b                 (rows read per request, predicated)
        max_q, max_k, dropout 0, is_causal=True, scale=..)

Causal masking in FA2 (>= 2.1) is aligned bottom-right when seqlen_q < seqlen_k: new token j
of a chunk sees keys ``0 .. context + j``, which is chunked prefill's rule. With ``max_q == 1``
(decode) FA2 drops the mask and folds the GQA group into the query rows. Rows at or past
``seqused_k`` are never read, so pages beyond each request's length may stay unmapped.
Requirements: bf16/fp16, ``head_dim % 8 == 0`` and ``<= 256``, ``num_slots * slot_tokens <
2**31`` (int32 offsets); float32 caches fall back to per-request SDPA with a warning.

Other kernels (``kernel=`` or ``$VMKV_ATTENTION_BACKEND``): ``flash-attn`` (the package's
``flash_attn_with_kvcache`` with ``cache_batch_idx`` = slot ids; not installed on the H200
machine), ``triton`` (the contiguous twin of :mod:`vmkv.kernels.triton_decode`, to compare twin
against twin), ``sdpa``. See :mod:`vmkv.attention.cuda_common`.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np
import torch

from vmkv.attention.base import AttentionMetadata
from vmkv.attention.cuda_common import (
    ATEN_REQUIRED_KWARGS,
    CudaAttentionBackend,
    HostStep,
    KernelFn,
    aten_flash_kwargs,
    cumsum0,
    flash_attn_module,
    flash_unsupported,
    requested_kernel,
    token_positions,
    warn_fallback,
)
from vmkv.attention.kv_store import StoreFn, triton_usable
from vmkv.attention.sdpa import attend_rows
from vmkv.kv.virtual import VirtualKVCache

INT32_MAX = 2**31 - 1


def resolve_virtual_kernel(requested: str, dtype: torch.dtype, head_dim: int, *,
                           flash_attn: bool, aten: bool, triton: bool, rows_fit_int32: bool
                           ) -> str:
    """The kernel a virtual cache of ``dtype``/``head_dim`` runs with (warns on fallback).

    "auto" takes flash-attn, else aten-flash; where FlashAttention cannot run it falls back to
    the Triton twin (fp16/bf16) or per-request SDPA (float32). An explicitly requested kernel
    that cannot exist here raises ValueError; one that exists but cannot take the dtype falls
    back to SDPA with a warning.
    """
    name = "virtual-cuda"
    flash_reason = flash_unsupported(dtype, head_dim)
    if not aten:
        aten_reason: str | None = ("torch's aten._flash_attention_forward with "
                                   f"{sorted(ATEN_REQUIRED_KWARGS)} is unavailable here")
    elif not rows_fit_int32:
        aten_reason = "num_slots * slot_tokens must be < 2**31 (FlashAttention's int32 offsets)"
    else:
        aten_reason = None
    if requested == "flash":
        requested = "flash-attn" if flash_attn else "aten-flash"
    if requested == "auto":
        if flash_reason is None and flash_attn:
            return "flash-attn"
        if flash_reason is None and aten_reason is None:
            return "aten-flash"
        fallback = "triton" if triton and dtype != torch.float32 else "sdpa"
        warn_fallback(name, flash_reason or aten_reason or "", fallback)
        return fallback
    if requested == "flash-attn" and not flash_attn:
        raise ValueError(f"{name}: kernel 'flash-attn' needs the flash_attn package")
    if requested == "aten-flash" and aten_reason is not None:
        raise ValueError(f"{name}: kernel 'aten-flash': {aten_reason}")
    if requested == "triton" and not triton:
        raise ValueError(f"{name}: kernel 'triton' needs Triton able to launch kernels here "
                         "(not installed, or its launch failed: see the warning)")
    if requested in ("flash-attn", "aten-flash") and flash_reason is not None:
        warn_fallback(name, flash_reason, "sdpa")
        return "sdpa"
    return requested


class VirtualCudaBackend(CudaAttentionBackend):
    """Attention over a :class:`VirtualKVCache` on CUDA (FlashAttention on the slot views).

    Args:
        kv: the virtual KV cache.
        kernel: see :mod:`vmkv.attention.cuda_common` (None: ``$VMKV_ATTENTION_BACKEND``, else
            "auto").
        varlen_fn: replaces ``torch.ops.aten._flash_attention_forward`` (same signature).
            Only tests pass it: the real kernel runs only on a GPU.
        flash_attn: replaces the ``flash_attn`` module (tests).
        store: replaces the K/V write (tests).
    """

    def __init__(self, kv: VirtualKVCache, kernel: str | None = None, *,
                 varlen_fn: KernelFn | None = None, flash_attn: ModuleType | None = None,
                 store: StoreFn | None = None) -> None:
        super().__init__(kv.device, store)
        self.kv = kv
        self.slot_tokens = kv.layout.slot_tokens
        self.max_seq_len_bound = self.slot_tokens
        spec = kv.spec
        self._fa = flash_attn if flash_attn is not None else flash_attn_module()
        aten = varlen_fn is not None or (
            kv.device.type == "cuda" and ATEN_REQUIRED_KWARGS.issubset(aten_flash_kwargs()))
        self._varlen: KernelFn = (varlen_fn if varlen_fn is not None
                                  else _aten_varlen if aten else _unavailable)
        self.kernel = resolve_virtual_kernel(
            requested_kernel(kernel), spec.dtype, spec.head_dim, flash_attn=self._fa is not None,
            aten=aten, triton=triton_usable(kv.device),
            rows_fit_int32=(kv.num_slots + 1) * self.slot_tokens <= INT32_MAX)
        self.name = f"virtual-{self.kernel}"
        # [num_slots + 1, slot_tokens, Hkv, D] strided views (slot 0: the anchor slot, always
        # mapped, so every base pointer is) and their [rows, Hkv, D] flattening
        self._views = [kv.layer_kv(i) for i in range(spec.num_layers)]
        self._flat = [(k.flatten(0, 1), v.flatten(0, 1)) for k, v in self._views]

    def flat_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._flat[layer]

    # -- step building ------------------------------------------------------------------------
    def build_step(self, request_ids: list[str], context_lens: list[int],
                   query_lens: list[int], *, pad_to: int | None = None) -> HostStep:
        pad = self._check_pad(query_lens, pad_to)
        t = self.slot_tokens
        slots = np.fromiter((self.kv.slot(r) for r in request_ids), np.int64, len(request_ids))
        ctx = np.asarray(context_lens, dtype=np.int64).reshape(-1)
        qlens = np.asarray(query_lens, dtype=np.int64).reshape(-1)
        seq = ctx + qlens
        starts = slots * t
        _, pos = token_positions(ctx, qlens)
        write = np.repeat(starts, qlens) + pos  # [T] flat rows of the new tokens
        seq_rows = [(int(s), int(n)) for s, n in zip(starts, seq, strict=True)]
        if pad:  # padding: the anchor slot 0, length 0 (nothing read), row -1 (nothing written)
            zeros = np.zeros(pad, dtype=np.int64)
            slots, starts, seq = (np.concatenate([a, zeros]) for a in (slots, starts, seq))
            qlens = np.concatenate([qlens, np.ones(pad, dtype=np.int64)])
            write = np.concatenate([write, np.full(pad, -1, dtype=np.int64)])
        cu_k = np.empty(len(slots) + 1, dtype=np.int64)
        cu_k[:-1] = starts
        cu_k[-1] = starts[-1] + seq[-1] if len(slots) else 0
        arrays = {
            "write_rows": write,  # int64 [T]
            "cu_seqlens_q": cumsum0(qlens).astype(np.int32),  # [B+1]
            "cu_seqlens_k": cu_k.astype(np.int32),  # [B+1] slot starts (not monotonic)
            "seq_lens": seq.astype(np.int32),  # [B] seqused_k
            "slot_ids": slots.astype(np.int32),  # [B] (Triton twin, flash-attn)
        }
        is_decode = bool((qlens == 1).all())
        if pad_to is not None:  # static bounds: a graph replays with any lengths
            max_q, max_seq = 1, self.max_seq_len_bound
        else:
            max_q = int(qlens.max()) if len(qlens) else 1
            max_seq = int(seq.max()) if len(seq) else 1
        return HostStep(list(request_ids), list(context_lens), list(query_lens), arrays,
                        max_q, max_seq, is_decode, pad, seq_rows)

    # -- kernels ------------------------------------------------------------------------------
    def attend(self, layer: int, q: torch.Tensor, meta: AttentionMetadata, scale: float
               ) -> torch.Tensor:
        x: dict[str, Any] = meta.extra
        if self.kernel == "aten-flash":
            k_flat, v_flat = self._flat[layer]
            out = self._varlen(q, k_flat, v_flat, x["cu_seqlens_q"], x["cu_seqlens_k"],
                               x["max_query_len"], x["max_seq_len"], 0.0, True, False,
                               scale=scale, seqused_k=x["seq_lens"])
            return out[0]  # [T, Hq, D]
        k_view, v_view = self._views[layer]
        if self.kernel == "triton":
            from vmkv.kernels import triton_decode as td

            if x["is_decode"]:
                return td.decode_contiguous(q, k_view, v_view, x["slot_ids"], x["seq_lens"],
                                            scale)
            return td.prefill_contiguous(q, k_view, v_view, x["slot_ids"], x["cu_seqlens_q"],
                                         x["seq_lens"], x["max_query_len"], scale)
        if self.kernel == "flash-attn":
            return self._flash_attn(q, k_view, v_view, meta, scale)
        return self._sdpa(layer, q, meta, scale)

    def _flash_attn(self, q: torch.Tensor, k_view: torch.Tensor, v_view: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
        x: dict[str, Any] = meta.extra
        fa: Any = self._fa
        if x["is_decode"]:  # vAttention's decode call: one batch, slots picked by index
            out = fa.flash_attn_with_kvcache(q.unsqueeze(1), k_view, v_view,
                                             cache_seqlens=x["seq_lens"],
                                             cache_batch_idx=x["slot_ids"],
                                             softmax_scale=scale, causal=True)
            return out.squeeze(1)
        out = torch.empty_like(q)
        pos = 0
        for b, ((start, _), n) in enumerate(zip(meta.seq_rows, meta.query_lens, strict=True)):
            slot = start // self.slot_tokens
            out[pos : pos + n] = fa.flash_attn_with_kvcache(
                q[pos : pos + n].unsqueeze(0), k_view[slot : slot + 1], v_view[slot : slot + 1],
                cache_seqlens=x["seq_lens"][b : b + 1], softmax_scale=scale, causal=True)[0]
            pos += n
        return out

    def _sdpa(self, layer: int, q: torch.Tensor, meta: AttentionMetadata, scale: float
              ) -> torch.Tensor:
        k_flat, v_flat = self._flat[layer]
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        attend_rows(out, q, k_flat, v_flat, meta, scale)
        return out.view_as(q)


def _aten_varlen(*args: Any, **kwargs: Any) -> Any:
    return torch.ops.aten._flash_attention_forward(*args, **kwargs)


def _unavailable(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("aten._flash_attention_forward is not available on this device")
