"""One host->device copy per step: a step's metadata arrays packed into one pinned buffer.

    host (pinned, ring of N):  | write_rows int64 | cu_seqlens_q int32 | ... | block_table |
                                  one copy_(non_blocking) per step
    device (bytes):            | write_rows       | cu_seqlens_q       | ... | block_table |
                                  typed views handed to the kernels (no further copies)

Fields sit at 16-byte aligned offsets in the order given, so the same fields with the same
shapes always land at the same offsets: a CUDA graph captured over views of a static
destination buffer reads new values after :meth:`StagingBuffer.pack` copies into that buffer
again (``dst=``).

Invariant: a host buffer is rewritten only after the copy that last read it has completed
(one CUDA event per host buffer), so the CPU may run ahead of the GPU by N - 1 steps.
On a CPU device nothing is pinned and the copy is synchronous (tests).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

ALIGN = 16

_TORCH_DTYPES = {
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.float32): torch.float32,
}


@dataclass(frozen=True)
class Field:
    """Where one array lives in the packed buffer."""

    name: str
    offset: int
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def layout(arrays: Mapping[str, np.ndarray]) -> tuple[tuple[Field, ...], int]:
    """Fields (in ``arrays`` order, 16-byte aligned) and the total bytes they need."""
    fields = []
    offset = 0
    for name, arr in arrays.items():
        dtype = np.dtype(arr.dtype)
        if dtype not in _TORCH_DTYPES:
            raise ValueError(f"field {name!r}: dtype {dtype} is not one of {list(_TORCH_DTYPES)}")
        fields.append(Field(name, offset, dtype, tuple(arr.shape)))
        offset += -(-fields[-1].nbytes // ALIGN) * ALIGN
    return tuple(fields), max(offset, ALIGN)


class StagingBuffer:
    """Packs named int arrays into a pinned host buffer and copies them to ``device`` at once.

    Args:
        device: where the views live ("cuda:N"; "cpu" in tests).
        capacity: initial bytes (grows on demand).
        num_host_buffers: pinned buffers in the ring (how far the CPU may run ahead).
    """

    def __init__(self, device: torch.device | str, capacity: int = 1 << 16,
                 num_host_buffers: int = 3) -> None:
        if num_host_buffers < 1:
            raise ValueError(f"num_host_buffers must be >= 1, got {num_host_buffers}")
        self.device = _indexed(torch.device(device))
        self._is_cuda = self.device.type == "cuda"
        self._host: list[torch.Tensor] = [self._new_host(capacity)
                                           for _ in range(num_host_buffers)]
        self._events: list[torch.cuda.Event | None] = [None] * num_host_buffers
        self._next = 0
        self._dev = torch.empty(capacity, dtype=torch.uint8, device=self.device)
        self.num_copies = 0  # host->device transfers issued (one per pack)

    def _new_host(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._is_cuda)

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        """A fresh device byte buffer of ``nbytes`` (e.g. a CUDA graph's static inputs)."""
        return torch.zeros(max(nbytes, ALIGN), dtype=torch.uint8, device=self.device)

    def pack(self, arrays: Mapping[str, np.ndarray], dst: torch.Tensor | None = None
             ) -> dict[str, torch.Tensor]:
        """Copy ``arrays`` to the device in one transfer; return typed device views by name.

        ``dst``: device byte buffer to copy into (default: this staging's own buffer, reused
        every step, so the views are valid until the next :meth:`pack` is *executed* on the
        stream). Raises ValueError when ``dst`` is too small.
        """
        fields, nbytes = layout(arrays)
        slot = self._next
        self._next = (slot + 1) % len(self._host)
        event = self._events[slot]
        if event is not None:
            event.synchronize()  # the copy that last read this host buffer is done
        if self._host[slot].numel() < nbytes:
            self._host[slot] = self._new_host(_grow(nbytes))
        host = self._host[slot]
        raw = host.numpy()
        for f in fields:
            arr = np.ascontiguousarray(arrays[f.name], dtype=f.dtype)
            raw[f.offset : f.offset + f.nbytes] = arr.reshape(-1).view(np.uint8)
        if dst is None:
            if self._dev.numel() < nbytes:
                self._dev = torch.empty(_grow(nbytes), dtype=torch.uint8, device=self.device)
            dst = self._dev
        elif dst.numel() < nbytes or dst.dtype != torch.uint8 or dst.device != self.device:
            raise ValueError(f"dst must be a uint8 buffer of >= {nbytes} B on {self.device}, "
                             f"got {dst.numel()} B {dst.dtype} on {dst.device}")
        dst[:nbytes].copy_(host[:nbytes], non_blocking=self._is_cuda)
        self.num_copies += 1
        if self._is_cuda:
            if event is None:
                event = self._events[slot] = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        return views(dst, fields)


def views(buffer: torch.Tensor, fields: tuple[Field, ...]) -> dict[str, torch.Tensor]:
    """Typed views of ``fields`` over the byte ``buffer`` (no copies)."""
    out = {}
    for f in fields:
        raw = buffer[f.offset : f.offset + f.nbytes]
        out[f.name] = raw.view(_TORCH_DTYPES[f.dtype]).view(f.shape)
    return out


def _indexed(device: torch.device) -> torch.device:
    """``device`` with its index filled in ("cuda" -> "cuda:<current>"), so that it compares
    equal to the ``.device`` of the tensors made on it."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _grow(nbytes: int) -> int:
    return 1 << max(16, (nbytes - 1).bit_length())
