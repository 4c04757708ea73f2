"""Preemption by swapping: a request's KV copied to host memory, and back under fresh memory.

    kv.swap.out(r)          SwapOut(r, where) -> its pages or blocks copied to host, then freed
    kv.swap.back(r, saved)  allocate(r, n), then SwapIn(r, where) -> the saved bytes copied back

Both copies are changes (:mod:`vmkv.kv.changes`), so every tensor-parallel rank moves its own
heads' bytes at the same point; ``where`` is ``(first va page, pages)`` in virtual mode and the
block ids in paged mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from vmkv.kv.changes import KVChange, SwapIn, SwapOut


@dataclass(frozen=True)
class SwappedKV:
    """A preempted request's KV copied to host memory (page- or block-granular)."""

    num_tokens: int
    data: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.data)


def host_copy(t: torch.Tensor, *, owned: bool = False) -> torch.Tensor:
    """A host copy of ``t`` (pinned when it comes from a GPU, for fast copies back); ``owned``
    host tensors (fresh gathers) are returned as they are."""
    if t.device.type == "cpu":
        return t if owned else t.clone()
    return t.to("cpu", copy=True).pin_memory()


class SwapState(Protocol):
    """What swapping needs of a mode's state (:class:`~vmkv.kv.changes.ChangeLog`)."""

    tokens: dict[str, int]
    saved: dict[str, list[torch.Tensor]]

    def commit(self, change: KVChange) -> KVChange | None: ...

    def swap_where(self, request_id: str) -> tuple[int, ...]: ...

    def track_swap_out(self, request_id: str, swapped: object) -> None: ...

    def track_swap_in(self, request_id: str) -> None: ...


class Allocator(Protocol):
    """What swapping needs of a mode's allocator."""

    def allocate(self, request_id: str, num_new_tokens: int) -> bool: ...

    def free(self, request_id: str) -> None: ...


class KVSwap:
    """Swap-out and swap-in of whole requests (the scheduler's ``--preemption-mode swap``)."""

    def __init__(self, state: SwapState, allocator: Allocator) -> None:
        self._state = state
        self._allocator = allocator

    def out(self, request_id: str) -> SwappedKV:
        """Copy ``request_id``'s KV to host memory, then free its device memory (KeyError for
        unknown ids)."""
        state = self._state
        num_tokens = state.tokens[request_id]
        state.commit(SwapOut(request_id, state.swap_where(request_id)))
        swapped = SwappedKV(num_tokens, state.saved.pop(request_id))
        state.track_swap_out(request_id, swapped)
        self._allocator.free(request_id)
        return swapped

    def back(self, request_id: str, swapped: SwappedKV) -> bool:
        """Allocate fresh memory for a swapped-out request and copy its KV back; False
        (nothing changed) when memory or slots are short. ValueError if it holds KV."""
        state = self._state
        if request_id in state.tokens:
            raise ValueError(f"swap.back of {request_id!r}, which already holds KV")
        if not self._allocator.allocate(request_id, swapped.num_tokens):
            return False
        state.saved[request_id] = list(swapped.data)  # what SwapIn copies back, here
        state.commit(SwapIn(request_id, state.swap_where(request_id)))
        state.track_swap_in(request_id)
        return True
