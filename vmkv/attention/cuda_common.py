"""Shared machinery of the CUDA attention backends: kernel choice, step building, graph hooks.

A step is built on the host as numpy arrays (:class:`HostStep`), copied to the KV device in
one transfer through a :class:`~vmkv.attention.staging.StagingBuffer`, and handed to the
kernels as typed views. CUDA graphs reuse the same path with ``pad_to``: a decode batch of B
entries is padded to the captured size with entries that write nothing (row -1) and attend
over nothing (length 0), and the arrays are copied into the graph's static buffer.

Kernel names (``kernel=`` argument or the ``VMKV_ATTENTION_BACKEND`` environment variable):

    auto        best available: flash-attn > aten-flash > triton > sdpa (virtual);
                flash-attn (block size % 256 == 0) > triton > sdpa (paged)
    flash       flash-attn if installed, else aten-flash (virtual) / triton (paged)
    flash-attn  the flash_attn package: flash_attn_with_kvcache (slots or block table)
    aten-flash  torch.ops.aten._flash_attention_forward, varlen + seqused_k (virtual only)
    triton      vmkv.kernels.triton_decode twins (decode kernel for decode-only batches,
                prefill twin otherwise)
    sdpa        torch SDPA per request (the fallback for float32 and odd head sizes)
"""

from __future__ import annotations

import functools
import logging
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np
import torch

from vmkv import envs
from vmkv.attention.base import AttentionBackend, AttentionMetadata
from vmkv.attention.kv_store import StoreFn, default_store
from vmkv.attention.staging import StagingBuffer, layout

logger = logging.getLogger(__name__)

KERNELS = ("auto", "flash", "flash-attn", "aten-flash", "triton", "sdpa")
FLASH_DTYPES = (torch.float16, torch.bfloat16)
#: keyword arguments of aten._flash_attention_forward this code passes (present in 2.11+)
ATEN_REQUIRED_KWARGS = frozenset({"scale", "seqused_k"})


def requested_kernel(kernel: str | None) -> str:
    """``kernel`` or ``$VMKV_ATTENTION_BACKEND`` or "auto"; ValueError for unknown names."""
    name = kernel or envs.attention_backend()
    if name not in KERNELS:
        raise ValueError(f"attention kernel must be one of {KERNELS}, got {name!r}"
                         + ("" if kernel else f" (from ${envs.VMKV_ATTENTION_BACKEND.name})"))
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
    num_padded: int = 0
    seq_rows: list[Any] = field(default_factory=list)


def cumsum0(x: np.ndarray) -> np.ndarray:
    """``[0, x0, x0+x1, ...]`` as int64."""
    out = np.zeros(len(x) + 1, dtype=np.int64)
    np.cumsum(x, out=out[1:])
    return out


def token_positions(context_lens: np.ndarray, query_lens: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(request index, absolute position) of every new token, flattened in batch order."""
    total = int(query_lens.sum())
    req = np.repeat(np.arange(len(query_lens)), query_lens)
    starts = cumsum0(query_lens)[:-1]
    pos = np.arange(total, dtype=np.int64) - np.repeat(starts - context_lens, query_lens)
    return req, pos


class CudaAttentionBackend(AttentionBackend):
    """Base of the CUDA backends: one staging copy per step, graph-padding, K/V writes.

    Subclasses implement :meth:`build_step` (host arrays) and :meth:`attend` (the kernel).
    ``store`` (tests) replaces the K/V write; by default it is the masked Triton write on
    CUDA, ``index_copy_`` elsewhere.
    """

    kernel: str
    #: upper bound of any sequence's length (a graph's static ``max_seq_len``)
    max_seq_len_bound: int

    def __init__(self, device: torch.device, store: StoreFn | None = None) -> None:
        self.device = device
        self.staging = StagingBuffer(device)
        if store is None:
            store, capturable = default_store(device)
        else:
            capturable = True  # an injected write is taken at its word (tests)
        self._store = store
        self._store_capturable = capturable

    # -- the contract -------------------------------------------------------------------------
    def prepare(self, request_ids: list[str], context_lens: list[int], query_lens: list[int]
                ) -> AttentionMetadata:
        step = self.build_step(request_ids, context_lens, query_lens)
        return self.metadata(step, self.staging.pack(step.arrays))

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        k_flat, v_flat = self.flat_kv(layer)
        self._store(k_flat, v_flat, meta.write_rows, k, v)
        out = self.attend(layer, q, meta, scale)  # [T, Hq, D]
        return out.reshape(q.shape[0], q.shape[1] * q.shape[2])

    # -- subclass hooks -----------------------------------------------------------------------
    @abstractmethod
    def flat_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[rows, Hkv, D]`` K and V views of ``layer`` (where new rows are written)."""

    @abstractmethod
    def build_step(self, request_ids: list[str], context_lens: list[int],
                   query_lens: list[int], *, pad_to: int | None = None) -> HostStep:
        """Host arrays of a step; ``pad_to`` pads a decode-only batch to that many entries
        with fixed-width fields (the layout a CUDA graph was captured with)."""

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, meta: AttentionMetadata, scale: float
               ) -> torch.Tensor:
        """Attention of ``q [T, Hq, D]`` over the cache (new rows already written)."""

    @property
    def supports_cuda_graphs(self) -> bool:
        """Whether a decode step of this backend can be captured (no host sync, no per-request
        host loop): the write must be capturable and the kernel batched."""
        return self._store_capturable and self.kernel != "sdpa"

    # -- metadata -----------------------------------------------------------------------------
    def metadata(self, step: HostStep, tensors: dict[str, torch.Tensor]) -> AttentionMetadata:
        """The :class:`AttentionMetadata` of ``step`` over device ``tensors`` (its fields).

        ``extra`` holds the device tensors by field name plus host ints ``max_query_len``,
        ``max_seq_len`` and ``is_decode``.
        """
        extra: dict[str, object] = dict(tensors)
        extra.update(max_query_len=step.max_query_len, max_seq_len=step.max_seq_len,
                     is_decode=step.is_decode)
        return AttentionMetadata(step.request_ids, step.context_lens, step.query_lens,
                                 tensors["write_rows"], step.seq_rows, extra)

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

    # -- helpers ------------------------------------------------------------------------------
    @staticmethod
    def _check_pad(query_lens: list[int], pad_to: int | None) -> int:
        """Padding entries to add (0 without ``pad_to``); ValueError unless decode-only."""
        if pad_to is None:
            return 0
        if any(n != 1 for n in query_lens) or len(query_lens) > pad_to:
            raise ValueError(f"only decode batches of <= {pad_to} entries can be padded "
                             f"(got query lens {query_lens[:8]}...)")
        return pad_to - len(query_lens)


def warn_fallback(backend: str, reason: str, fallback: str) -> None:
    logger.warning("%s: %s; using the %s kernel instead", backend, reason, fallback)


KernelFn = Callable[..., Any]
