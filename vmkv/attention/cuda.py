"""Attention on CUDA, both KV modes: one backend over the step's addressing.

    virtual (slot ids)   aten FlashAttention-2, unmodified, on the slot views (vAttention's
                         point) | flash-attn (cache_batch_idx) | Triton contiguous twin | SDPA
    paged (block table)  flash-attn (block_table, block_size % 256 == 0) | Triton paged twin |
                         SDPA over gathered rows
    (kernel choice: :mod:`vmkv.attention.kernel_choice`)

Virtual mode = FlashAttention's varlen call on ``[num_slots + 1, slot_tokens, Hkv, D]`` slot
views flattened to rows; request b's keys are rows ``slot_b * slot_tokens ..``:

    aten._flash_attention_forward(q [T, Hq, D], k_flat, v_flat,
        cum_seq_q [B+1]  = 0, q_0, q_0+q_1, ...          (packed new tokens)
        cum_seq_k [B+1]  = slot_b * slot_tokens            (need not be monotonic)
        seqused_k [B]    = context_b + q_b                 (rows read per request, predicated)
        max_q, max_k, dropout 0, is_causal=True, scale=..)

Causal masking in FA2 (>= 2.1) is aligned bottom-right when seqlen_q < seqlen_k: new token j of
a chunk sees keys ``0 .. context + j``, chunked prefill's rule. A sliding-window layer
(``kv.spec.windows``) passes ``window_size_left = window - 1`` (and 0 on the right) to either
FlashAttention, the window to the Triton twins and to SDPA: no kernel reads a row before the
window, so those pages or blocks may be given back. Rows at or past ``seqused_k``
are never read, so pages beyond each request's length may stay unmapped. The Triton twins are
one kernel body with a ``PAGED`` switch, so virtual-triton vs paged-triton isolates address
translation.

A step is built on the host as numpy arrays (:class:`HostStep`), copied to the device in one
transfer through a :class:`~vmkv.attention.staging.StagingBuffer`, and handed to the kernels as
typed views (:class:`CudaStepMetadata`). CUDA graphs reuse the same path with ``pad_to``: a
decode batch of B entries is padded to the captured size with entries that write nothing
(row -1) and attend over nothing (length 0, the anchor slot or block 0), and the arrays are
copied into the graph's static buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch

from vmkv.attention.base import AttentionBackend, AttentionMetadata
from vmkv.attention.kernel_choice import (
    ATEN_REQUIRED_KWARGS,
    aten_flash_kwargs,
    flash_attn_module,
    requested_kernel,
    resolve_kernel,
)
from vmkv.attention.kv_store import StoreFn, default_store, triton_usable
from vmkv.attention.sdpa import attend_each
from vmkv.attention.staging import StagingBuffer, layout
from vmkv.attention.step import cumsum0, token_positions
from vmkv.kv.addressing import Addressing
from vmkv.kv.base import KVCacheManager

INT32_MAX = 2**31 - 1
KernelFn = Any  # aten._flash_attention_forward's signature


@dataclass
class HostStep:
    """A step's addressing on the host, before the copy to the device.

    ``arrays`` holds the device-bound fields in packing order; padded graph steps have
    ``num_padded`` extra decode entries that write nothing and read nothing.
    """

    request_ids: list[str]
    context_lens: list[int]
    query_lens: list[int]
    arrays: dict[str, np.ndarray]
    max_query_len: int
    max_seq_len: int
    is_decode: bool
    addressing: Addressing
    num_padded: int = 0


@dataclass
class CudaStepMetadata(AttentionMetadata):
    """A CUDA step's device tensors (views of one staged copy) and host bounds.

    Attributes:
        cu_seqlens_q: ``[B+1]`` int32 offsets of each request's new tokens.
        seq_lens: ``[B]`` int32 cached + new tokens (FlashAttention's ``seqused_k``).
        index: slot ids ``[B]`` int32 (virtual) or the block table ``[B, W]`` int32 (paged).
        cu_seqlens_k: virtual mode: ``[B+1]`` int32 slot starts (FlashAttention's varlen).
        seq_rows: the SDPA kernel only: each request's rows (a slice, or gathered row ids).
        max_query_len, max_seq_len: host bounds (a graph's are static).
        is_decode: every request brings one token.
    """

    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    index: torch.Tensor
    cu_seqlens_k: torch.Tensor | None
    seq_rows: list[slice | torch.Tensor] | None
    max_query_len: int
    max_seq_len: int
    is_decode: bool


class CudaAttentionBackend(AttentionBackend):
    """Attention over any KV manager on CUDA.

    Args:
        kv: the KV cache manager (virtual or paged).
        kernel: see :mod:`vmkv.attention.kernel_choice` (None: ``$VMKV_ATTENTION_BACKEND``,
            else "auto").
        varlen_fn: replaces ``torch.ops.aten._flash_attention_forward`` (same signature). Only
            tests pass it: the real kernel runs only on a GPU.
        flash_attn: replaces the ``flash_attn`` module (tests).
        store: replaces the K/V write (tests); by default the masked Triton write on CUDA,
            ``index_copy_`` elsewhere.
    """

    def __init__(self, kv: KVCacheManager, kernel: str | None = None, *,
                 varlen_fn: KernelFn | None = None, flash_attn: ModuleType | None = None,
                 store: StoreFn | None = None) -> None:
        self.kv = kv
        self.device = kv.device
        self.staging = StagingBuffer(self.device)
        if store is None:
            store, capturable = default_store(self.device)
        else:
            capturable = True  # an injected write is taken at its word (tests)
        self._store = store
        self._store_capturable = capturable
        spec = kv.spec
        #: each layer's sliding window in tokens (0: full attention)
        self.windows = spec.windows
        self.paged = kv.kv_mode == "paged"
        if self.paged and any(self.windows):
            raise ValueError("paged mode's block groups (sliding-window layers) run on the CPU "
                             "backend; on CUDA use --kv-mode virtual")
        # [outer, inner, Hkv, D] views (virtual: slot 0 is the anchor, always mapped, so every
        # base pointer is) and their [rows, Hkv, D] flattening
        self._views = [kv.layer_kv(i) for i in range(spec.num_layers)]
        self._flat = [(k.flatten(0, 1), v.flatten(0, 1)) for k, v in self._views]
        outer, inner = self._views[0][0].shape[:2]
        #: upper bound of any sequence's length (a graph's static ``max_seq_len``)
        self.max_seq_len_bound = kv.room.max_model_len if self.paged else inner
        self._fa = flash_attn if flash_attn is not None else flash_attn_module()
        aten = varlen_fn is not None or (
            self.device.type == "cuda" and ATEN_REQUIRED_KWARGS.issubset(aten_flash_kwargs()))
        self._varlen: KernelFn = varlen_fn if varlen_fn is not None else _aten_varlen
        self.kernel = resolve_kernel(
            requested_kernel(kernel), paged=self.paged, dtype=spec.dtype,
            head_dim=spec.head_dim, block_size=inner, flash_attn=self._fa is not None,
            aten=aten, triton=triton_usable(self.device),
            rows_fit_int32=outer * inner <= INT32_MAX)
        self.name = f"{kv.kv_mode}-{self.kernel}"

    def close(self) -> None:
        self._views, self._flat = [], []

    @property
    def supports_cuda_graphs(self) -> bool:  # type: ignore[override]
        """Whether a decode step can be captured (no host sync, no per-request host loop): the
        write must be capturable and the kernel batched."""
        return self._store_capturable and self.kernel != "sdpa"

    def flat_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[rows, Hkv, D]`` K and V views of ``layer`` (where new rows are written)."""
        return self._flat[layer]

    # -- the contract -------------------------------------------------------------------------
    def prepare(self, request_ids: list[str], context_lens: list[int], query_lens: list[int]
                ) -> CudaStepMetadata:
        step = self.build_step(request_ids, context_lens, query_lens)
        return self.metadata(step, self.staging.pack(step.arrays))

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        k_flat, v_flat = self._flat[layer]
        self._store(k_flat, v_flat, meta.write_rows, k, v)

    # -- step building ------------------------------------------------------------------------
    def build_step(self, request_ids: list[str], context_lens: list[int],
                   query_lens: list[int], *, pad_to: int | None = None) -> HostStep:
        """Host arrays of a step; ``pad_to`` pads a decode-only batch to that many entries
        with fixed-width fields (the layout a CUDA graph was captured with)."""
        pad = self._check_pad(query_lens, pad_to)
        addr = self.kv.addressing(request_ids, context_lens, full_width=pad_to is not None)
        ctx = np.asarray(context_lens, dtype=np.int64).reshape(-1)
        qlens = np.asarray(query_lens, dtype=np.int64).reshape(-1)
        seq = ctx + qlens
        req, pos = token_positions(ctx, qlens)
        write = addr.rows(req, pos)  # [T] flat rows of the new tokens
        if pad:  # padding: length 0 (nothing read), row -1 (nothing written)
            addr = addr.padded(pad)
            seq = np.concatenate([seq, np.zeros(pad, dtype=np.int64)])
            qlens = np.concatenate([qlens, np.ones(pad, dtype=np.int64)])
            write = np.concatenate([write, np.full(pad, -1, dtype=np.int64)])
        arrays = {
            "write_rows": write,  # int64 [T]
            "cu_seqlens_q": cumsum0(qlens).astype(np.int32),  # [B+1]
            "seq_lens": seq.astype(np.int32),  # [B] seqused_k
            **addr.kernel_arrays(seq),  # slot ids + slot starts, or the block table
        }
        if self.kernel == "sdpa" and addr.paged:  # every request's rows, gathered per request
            greq, gpos = token_positions(np.zeros_like(seq), seq)
            arrays["gather_rows"] = addr.rows(greq, gpos)
        is_decode = bool((qlens == 1).all())
        if pad_to is not None:  # static bounds: a graph replays with any lengths
            max_q, max_seq = 1, self.max_seq_len_bound
        else:
            max_q = int(qlens.max()) if len(qlens) else 1
            max_seq = int(seq.max()) if len(seq) else 1
        return HostStep(list(request_ids), list(context_lens), list(query_lens), arrays,
                        max_q, max_seq, is_decode, addr, pad)

    def metadata(self, step: HostStep, tensors: dict[str, torch.Tensor]) -> CudaStepMetadata:
        """The metadata of ``step`` over device ``tensors`` (its fields by name)."""
        addr = step.addressing
        seq_rows: list[slice | torch.Tensor] | None = None
        if self.kernel == "sdpa":
            seq = step.arrays["seq_lens"].tolist()
            if addr.paged:
                bounds = cumsum0(np.asarray(seq)).tolist()
                gather = tensors["gather_rows"]
                seq_rows = [gather[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
            else:
                seq_rows = [addr.sequence_rows(b, n) for b, n in enumerate(seq)]
        return CudaStepMetadata(
            step.request_ids, step.context_lens, step.query_lens, tensors["write_rows"], addr,
            cu_seqlens_q=tensors["cu_seqlens_q"], seq_lens=tensors["seq_lens"],
            index=tensors["block_table" if addr.paged else "slot_ids"],
            cu_seqlens_k=tensors.get("cu_seqlens_k"), seq_rows=seq_rows,
            max_query_len=step.max_query_len, max_seq_len=step.max_seq_len,
            is_decode=step.is_decode)

    # -- kernels ------------------------------------------------------------------------------
    def attend(self, layer: int, q: torch.Tensor, meta: AttentionMetadata, scale: float
               ) -> torch.Tensor:
        assert isinstance(meta, CudaStepMetadata)
        t, heads, dim = q.shape
        return self._kernel(layer, q, meta, scale).reshape(t, heads * dim)

    def _kernel(self, layer: int, q: torch.Tensor, meta: CudaStepMetadata, scale: float
                ) -> torch.Tensor:
        """``[T, Hq, D]`` attention of ``q [T, Hq, D]`` with the chosen kernel."""
        k_flat, v_flat = self._flat[layer]
        window = self.windows[layer]
        if self.kernel == "aten-flash":
            sliding = ({"window_size_left": window - 1, "window_size_right": 0} if window
                       else {})
            out = self._varlen(q, k_flat, v_flat, meta.cu_seqlens_q, meta.cu_seqlens_k,
                               meta.max_query_len, meta.max_seq_len, 0.0, True, False,
                               scale=scale, seqused_k=meta.seq_lens, **sliding)
            return out[0]  # [T, Hq, D]
        k, v = self._views[layer]
        if self.kernel == "triton":
            from vmkv.kernels import triton_decode as td

            if meta.is_decode:
                decode = td.decode_paged if self.paged else td.decode_contiguous
                return decode(q, k, v, meta.index, meta.seq_lens, scale, window=window)
            prefill = td.prefill_paged if self.paged else td.prefill_contiguous
            return prefill(q, k, v, meta.index, meta.cu_seqlens_q, meta.seq_lens,
                           meta.max_query_len, scale, window=window)
        if self.kernel == "flash-attn":
            return self._flash_attn(q, k, v, meta, scale, window)
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        assert meta.seq_rows is not None
        attend_each(out, q, k_flat, v_flat, meta.context_lens, meta.query_lens, meta.seq_rows,
                    scale, window)
        return out.view_as(q)

    def _flash_attn(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    meta: CudaStepMetadata, scale: float, window: int) -> torch.Tensor:
        """``flash_attn_with_kvcache`` with the slots picked by ``cache_batch_idx`` (virtual,
        vAttention's decode call) or a ``block_table`` (paged); prefill chunks one by one."""
        fa: Any = self._fa
        select = {"block_table" if self.paged else "cache_batch_idx": meta.index}
        sliding = {"window_size": (window - 1, 0)} if window else {}
        if meta.is_decode:
            out = fa.flash_attn_with_kvcache(q.unsqueeze(1), k, v, cache_seqlens=meta.seq_lens,
                                             **select, softmax_scale=scale, causal=True,
                                             **sliding)
            return out.squeeze(1)
        out = torch.empty_like(q)
        pos = 0
        for b, n in enumerate(meta.query_lens):
            one = {name: index[b : b + 1] for name, index in select.items()}
            out[pos : pos + n] = fa.flash_attn_with_kvcache(
                q[pos : pos + n].unsqueeze(0), k, v, cache_seqlens=meta.seq_lens[b : b + 1],
                **one, softmax_scale=scale, causal=True, **sliding)[0]
            pos += n
        return out

    # -- CUDA graphs --------------------------------------------------------------------------
    def graph_step(self, batch_size: int) -> HostStep:
        """A decode step of ``batch_size`` padding entries (what a graph is captured with)."""
        return self.build_step([], [], [], pad_to=batch_size)

    def graph_buffer(self, step: HostStep, extra_arrays: dict[str, np.ndarray]
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """A static device buffer holding ``step``'s fields and ``extra_arrays`` (input ids,
        positions...), filled once; returns it with the typed views."""
        arrays = {**step.arrays, **extra_arrays}
        _, nbytes = layout(arrays)
        buffer = self.staging.device_buffer(nbytes)
        return buffer, self.staging.pack(arrays, dst=buffer)

    @staticmethod
    def _check_pad(query_lens: list[int], pad_to: int | None) -> int:
        """Padding entries to add (0 without ``pad_to``); ValueError unless decode-only."""
        if pad_to is None:
            return 0
        if any(n != 1 for n in query_lens) or len(query_lens) > pad_to:
            raise ValueError(f"only decode batches of <= {pad_to} entries can be padded "
                             f"(got query lens {query_lens[:8]}...)")
        return pad_to - len(query_lens)


def _aten_varlen(*args: Any, **kwargs: Any) -> Any:
    return torch.ops.aten._flash_attention_forward(*args, **kwargs)
