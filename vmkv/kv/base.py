"""The KV cache manager contract shared by the virtual (vAttention) and paged modes.

The scheduler talks only to this interface: it asks for room for N more tokens of a request and
gets ``True`` or ``False`` ("cannot": the scheduler decides whether to preempt). Neither answer
leaves partial state behind. Attention backends ask for the tensors and the per-request
addressing (slot ids or block tables).

    KVCacheManager          kv_mode, spec, device        what it is
      allocate / free / fork                             a request's room (the scheduler)
      layer_kv / addressing                              where the rows are (attention)
      room                  num_tokens, holds, can_allocate, units_needed, free_units, ...
      swap                  out / back                   preemption by swapping
      prefix                enabled, match, publish, reset, stats
      changes               record / take / apply        decisions as data (tensor parallel)
      mapping               start / ahead / paused       the background mapper
      accounting            usage, capacity_tokens, describe, memory_stats, vma budget, check
      close

Each part has one job (:mod:`vmkv.kv.room`, :mod:`vmkv.kv.swap`, :mod:`vmkv.kv.prefix`,
:mod:`vmkv.kv.changes`, :mod:`vmkv.kv.mapping`, :mod:`vmkv.kv.accounting`); a mode builds them
over its state, which only its change log's ``commit`` changes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol

import torch

from vmkv.kv.accounting import KVAccounting, KVUsage
from vmkv.kv.addressing import Addressing
from vmkv.kv.changes import ChangeLog
from vmkv.kv.mapping import KVMapping
from vmkv.kv.prefix import PrefixCacheStats, PrefixPart
from vmkv.kv.room import KVRoom
from vmkv.kv.spec import KVSpec
from vmkv.kv.swap import KVSwap, SwappedKV
from vmkv.memory.errors import VmmError

__all__ = ["KVCacheManager", "KVUsage", "PrefixCacheStats", "SwappedKV", "VmmError"]


class RequestAllocator(Protocol):
    """A mode's allocator: what :meth:`KVCacheManager.allocate`, ``free`` and ``fork`` do."""

    def allocate(self, request_id: str, num_new_tokens: int) -> bool: ...

    def free(self, request_id: str) -> None: ...

    def truncate(self, request_id: str, num_tokens: int) -> None: ...

    def fork(self, parent_id: str, child_id: str) -> bool: ...


class KVCacheManager(ABC):
    """Owns the KV memory of all requests of one engine.

    Invariants: a request's room only grows until :meth:`free` (which may also roll it back
    to fewer tokens); ``allocate`` and ``fork`` are
    all-or-nothing; after every request is freed nothing is held but reusable capacity. A mode
    sets its allocator and parts in ``__init__`` (``_allocator``, ``_room``, ``_swap``,
    ``_prefix``, ``_changes``, ``_mapping``, ``_accounting``).
    """

    #: "virtual" or "paged"
    kv_mode: str
    #: what one token's KV is (layers, heads, head size, the KV dtype)
    spec: KVSpec
    device: torch.device

    _allocator: RequestAllocator
    _room: KVRoom
    _swap: KVSwap
    _prefix: PrefixPart
    _changes: ChangeLog
    _mapping: KVMapping
    _accounting: KVAccounting

    def allocate(self, request_id: str, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``request_id`` (registering it on
        first use). Returns False, changing nothing, when memory or slots are short.

        Raises ValueError when the request would exceed ``room.max_model_len``, and
        :class:`VmmError` when the OS or driver refuses memory (a create or map failed): the
        request keeps the room it had and the accounting stays exact
        (``accounting.check()``), so the caller may fail that request alone. ``fork``,
        ``swap.back`` and ``prefix.match`` raise it the same way.
        """
        return self._allocator.allocate(request_id, num_new_tokens)

    def free(self, request_id: str, *, keep_tokens: int | None = None) -> None:
        """Release everything ``request_id`` holds; unknown ids raise KeyError.

        With ``keep_tokens``, roll it back instead: it keeps its first ``keep_tokens``
        tokens (and its slot or block table) and gives back its room past them
        (speculative decoding's rejected tokens): paged mode frees the blocks past the new
        end, virtual mode keeps the pages past it mapped as slack up to the pages a growth
        maps ahead (``premap_pages``) and unmaps the rest. A rollback is KV changes like any
        mutation (tensor-parallel ranks apply it); ValueError unless
        ``0 <= keep_tokens <= room.num_tokens(request_id)``.
        """
        if keep_tokens is None:
            self._allocator.free(request_id)
            return
        held = self._room.num_tokens(request_id)
        if not self._room.holds(request_id):
            raise KeyError(request_id)
        if not 0 <= keep_tokens <= held:
            raise ValueError(f"keep_tokens must be in [0, {held}] for {request_id!r}, "
                             f"got {keep_tokens}")
        if keep_tokens < held:
            self._allocator.truncate(request_id, keep_tokens)

    def fork(self, parent_id: str, child_id: str) -> bool:
        """Make ``child_id`` share ``parent_id``'s tokens copy-on-write; False if it cannot."""
        return self._allocator.fork(parent_id, child_id)

    @abstractmethod
    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as ``[outer, inner, kv_head, head_dim]`` views (slots x
        slot tokens, or blocks x block size; see :mod:`vmkv.kv.addressing`)."""

    @abstractmethod
    def addressing(self, request_ids: Sequence[str], context_lens: Sequence[int], *,
                   full_width: bool = False) -> Addressing:
        """Where the step's requests' K/V rows live (slot ids, or a block table).

        ``context_lens`` (tokens each had before this step) lets a manager refresh only what
        this step may have changed; ``full_width`` sizes a block table for ``max_model_len``
        (the fixed layout a CUDA graph was captured with).
        """

    def close(self) -> None:
        """Release all memory; the manager is unusable afterwards."""

    # -- the parts ----------------------------------------------------------------------------
    @property
    def room(self) -> KVRoom:
        """What each request holds and what more would take (no side effects)."""
        return self._room

    @property
    def swap(self) -> KVSwap:
        """Swapping whole requests out to host memory and back."""
        return self._swap

    @property
    def prefix(self) -> PrefixPart:
        """Prefix caching (``prefix.enabled`` False when off)."""
        return self._prefix

    @property
    def changes(self) -> ChangeLog:
        """The change log: ``record()`` / ``take()`` on rank 0, ``apply(changes)`` on the
        other tensor-parallel ranks (:mod:`vmkv.kv.changes`)."""
        return self._changes

    @property
    def mapping(self) -> KVMapping:
        """The background mapper: ``start()``, ``ahead(tokens)``, ``paused()``."""
        return self._mapping

    @property
    def accounting(self) -> KVAccounting:
        """Usage, capacity, start-up line, backend counters, VMA budget, ``check()``."""
        return self._accounting
