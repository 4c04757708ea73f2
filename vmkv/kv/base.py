"""The KV cache manager contract shared by the virtual (vAttention) and paged modes.

The scheduler talks only to this interface: it asks for room for N more tokens of a request and
gets ``True`` or ``False`` ("cannot": the scheduler decides whether to preempt). Neither answer
leaves partial state behind. Attention backends ask the mode-specific subclass for the tensors
and per-request addressing (slot ids or block tables).

    request r:  | < num_tokens(r): room already allocated > | < allocate(r, n): n more > |
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

from vmkv.kv.addressing import Addressing
from vmkv.kv.changes import DropSwapped, KVChange, SwapOut
from vmkv.kv.prefix import PrefixCaching
from vmkv.kv.spec import KVSpec
from vmkv.memory.errors import VmmError

__all__ = ["KVCacheManager", "KVUsage", "PrefixCacheStats", "SwappedKV", "VmmError"]

if TYPE_CHECKING:
    from vmkv.memory.mapper import BackgroundMapper


@dataclass(frozen=True)
class SwappedKV:
    """A preempted request's KV copied to host memory (page- or block-granular)."""

    num_tokens: int
    data: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.data)


@dataclass(frozen=True)
class KVUsage:
    """A snapshot of KV memory use; all byte counts are physical unless named ``virt_``.

    ``bytes_in_use`` counts memory that live requests' tokens need (shared pages or blocks once).
    ``bytes_held`` adds what the manager keeps mapped for reuse beyond that (deferred slots,
    pre-mapped tail pages); ``bytes_created`` adds idle pool pages not yet returned to the OS.
    ``bytes_cached`` is memory only the prefix cache holds: reusable by a later request with the
    same prefix, evicted when memory is needed (users misread it as "in use" elsewhere).
    ``bytes_allocated`` is what the operating system or driver has committed for the KV pool as
    it counts it (host: the memfd's allocated blocks, the anchor page included; RSS misses
    unmapped pages); paged mode allocates its whole block tensor at start-up.
    """

    num_requests: int
    num_tokens: int
    capacity_bytes: int
    bytes_in_use: int
    bytes_held: int
    bytes_created: int
    token_bytes: int  # bytes the live tokens themselves occupy (the useful part)
    virt_reserved_bytes: int
    bytes_cached: int = 0  # held only by the prefix cache (evictable; not "in use")
    bytes_allocated: int = 0  # what the OS/driver holds for the pool (host: memfd blocks)

    @property
    def fraction(self) -> float:
        """Share of the capacity in use by live requests (vLLM's ``kv_cache_usage_perc``)."""
        return self.bytes_in_use / self.capacity_bytes if self.capacity_bytes else 0.0

    @property
    def useful_fraction(self) -> float:
        """Share of the memory in use that holds live tokens' K/V."""
        return self.token_bytes / self.bytes_in_use if self.bytes_in_use else 1.0

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "fraction": self.fraction, "useful_fraction": self.useful_fraction}


@dataclass(frozen=True)
class PrefixCacheStats:
    """Prefix caching's counters since start-up: prompt tokens looked up, and found."""

    enabled: bool
    queries: int = 0
    hits: int = 0


class KVCacheManager(ABC):
    """Owns the KV memory of all requests of one engine.

    Invariants: a request's room only grows until :meth:`free`; ``allocate`` and ``fork`` are
    all-or-nothing; after every request is freed nothing is held but reusable capacity.
    """

    #: "virtual" or "paged"
    kv_mode: str
    spec: KVSpec
    max_model_len: int
    device: torch.device

    @abstractmethod
    def allocate(self, request_id: str, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``request_id`` (registering it on
        first use). Returns False, changing nothing, when memory or slots are short.

        Raises ValueError when the request would exceed ``max_model_len``, and
        :class:`VmmError` when the OS or driver refuses memory (a create or map failed): the
        request keeps the room it had and the accounting stays exact (``check()``), so the
        caller may fail that request alone. ``fork``, ``swap_in`` and ``match_prefix`` raise it
        the same way.
        """

    @abstractmethod
    def can_allocate(self, request_id: str, num_new_tokens: int) -> bool:
        """Whether :meth:`allocate` with the same arguments would succeed now (no side effects)."""

    @abstractmethod
    def units_needed(self, request_id: str, num_new_tokens: int) -> int | None:
        """Memory units (pages over all regions, or blocks) :meth:`allocate` would take, copies
        included; None when the request could not get a slot at all."""

    @property
    @abstractmethod
    def free_units(self) -> int:
        """Units free or reclaimable now (the scheduler's admission headroom)."""

    @abstractmethod
    def free(self, request_id: str) -> None:
        """Release everything ``request_id`` holds; unknown ids raise KeyError."""

    @abstractmethod
    def fork(self, parent_id: str, child_id: str) -> bool:
        """Make ``child_id`` share ``parent_id``'s tokens copy-on-write; False if it cannot."""

    @abstractmethod
    def swap_out(self, request_id: str) -> SwappedKV:
        """Copy ``request_id``'s KV to host memory and free its device memory."""

    @abstractmethod
    def swap_in(self, request_id: str, swapped: SwappedKV) -> bool:
        """Allocate fresh memory for a swapped-out request and copy its KV back; False (nothing
        changed) when memory or slots are short."""

    @abstractmethod
    def num_tokens(self, request_id: str) -> int:
        """Tokens of room allocated to ``request_id`` so far (0 if unknown)."""

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

    @property
    @abstractmethod
    def usage(self) -> KVUsage:
        """Exact accounting of the memory this manager holds now."""

    @property
    @abstractmethod
    def capacity_tokens(self) -> int:
        """Tokens that fit in the physical budget (the startup report's "KV cache size")."""

    @abstractmethod
    def check(self) -> None:
        """Raise AssertionError if internal accounting is inconsistent (tests call this)."""

    def close(self) -> None:
        """Release all memory; the manager is unusable afterwards."""

    @abstractmethod
    def describe(self) -> str:
        """One line on the mode's geometry (slots and pages, or blocks) for start-up reports."""

    def memory_stats(self) -> dict[str, dict[str, float]]:
        """Per-operation counters of the memory backend (map, unmap, create, release: calls,
        pages, time); empty where no pages are mapped at run time (paged mode)."""
        return {}

    @property
    def vma_budget(self) -> int | None:
        """Most VMAs the mappings may take (virtual mode on the host: the process's share of
        ``vm.max_map_count``); None where there is no such limit."""
        return None

    def limit_vma_budget(self, budget: int) -> None:
        """Lower :attr:`vma_budget` to ``budget`` (tensor-parallel ranks agree on the smallest,
        so that the same calls get the same answers on every rank); no-op without a budget."""

    # -- background pre-mapping (virtual mode on CUDA; see vmkv.memory.mapper) ----------------
    #: the mapper thread :meth:`start_background_mapper` started (closed with the manager)
    mapper: BackgroundMapper | None = None

    def start_background_mapper(self) -> BackgroundMapper | None:
        """Start a mapper thread that pre-maps pages while the device computes, owned by this
        manager (:attr:`mapper`); None where there is nothing to pre-map."""
        return None

    @contextmanager
    def mapping_ahead(self, lookahead_tokens: int) -> Iterator[None]:
        """While the body runs (the device computes), the mapper pre-maps the pages the
        running requests' next ``lookahead_tokens`` tokens need; on leaving, wait for it, so
        no KV call between steps ever races with it. Without a mapper: nothing."""
        mapper = self.mapper
        if mapper is None:
            yield
            return
        mapper.submit(self.premap_ahead(lookahead_tokens))
        try:
            yield
        finally:
            mapper.wait()

    def premap_ahead(self, lookahead_tokens: int) -> list[Callable[[], int]]:
        """Units of work for the mapper: the pages running requests' next ``lookahead_tokens``
        tokens need (none by default)."""
        return []

    # -- prefix caching (off unless the manager enables it; see vmkv.kv.prefix) -----------------
    prefix: PrefixCaching | None = None

    def match_prefix(self, request_id: str, token_ids: Sequence[int],
                     cache_salt: str | None = None) -> int:
        """Give a request that holds no KV yet the longest cached prefix of ``token_ids``;
        returns the tokens it now has (0 when prefix caching is off)."""
        if self.prefix is None:
            return 0
        return self.prefix.match(request_id, token_ids, cache_salt)

    def cache_computed(self, request_id: str, token_ids: Sequence[int], num_computed: int,
                       cache_salt: str | None = None) -> None:
        """Publish the request's completely computed units to the prefix cache (no-op if off)."""
        if self.prefix is not None:
            self.prefix.publish(request_id, token_ids, num_computed, cache_salt)

    def reset_prefix_cache(self) -> int:
        """Forget every cached unit; returns how many (0 when prefix caching is off)."""
        return self.prefix.reset() if self.prefix is not None else 0

    @property
    def prefix_caching(self) -> bool:
        """Whether prefix caching is on (requests may start with cached tokens)."""
        return self.prefix is not None

    def prefix_stats(self) -> PrefixCacheStats:
        """Prefix caching's lookups and hits (in prompt tokens) since start-up."""
        prefix = self.prefix
        if prefix is None:
            return PrefixCacheStats(enabled=False)
        return PrefixCacheStats(True, prefix.queries, prefix.hits)

    def has_request(self, request_id: str) -> bool:
        return self.num_tokens(request_id) > 0 or request_id in self.request_ids()

    @abstractmethod
    def request_ids(self) -> list[str]:
        """Requests currently holding memory."""

    @abstractmethod
    def units_of(self, request_id: str) -> list[int]:
        """The physical units holding ``request_id``'s tokens: its block ids, or its slot's
        pages in the first region (what must agree on every tensor-parallel rank)."""

    # -- decisions as data (tensor parallelism; see vmkv.kv.changes) ---------------------------
    #: the changes made since :meth:`take_changes`, while recording; None when not recording
    changes: list[KVChange] | None = None

    def record_changes(self) -> None:
        """From now on, log every change this manager makes (rank 0 of tensor parallelism)."""
        self.changes = []
        # swapped-out requests whose saved KV the other ranks hold: dropped when rank 0's is
        self._swapped_out: weakref.WeakValueDictionary[str, SwappedKV] = (
            weakref.WeakValueDictionary())
        self._swaps_held: set[str] = set()

    def take_changes(self) -> list[KVChange]:
        """The changes since the last take, in order (see :mod:`vmkv.kv.changes`)."""
        changes, self.changes = self.changes or [], []
        dropped = tuple(r for r in self._swaps_held if r not in self._swapped_out)
        if dropped:
            self._swaps_held.difference_update(dropped)
            changes.append(DropSwapped(dropped))
        return changes

    @abstractmethod
    def apply_changes(self, changes: Sequence[KVChange]) -> None:
        """Make the changes another manager of the same geometry recorded, deciding nothing:
        the same slots, pages or blocks, the same copies of this manager's own bytes."""

    def _record(self, change: KVChange) -> None:
        if self.changes is not None:
            self.changes.append(change)

    def _record_swap_out(self, swapped: SwappedKV, change: SwapOut) -> None:
        if self.changes is not None:
            self.changes.append(change)
            self._swapped_out[change.request_id] = swapped
            self._swaps_held.add(change.request_id)

    @staticmethod
    def _host_copy(t: torch.Tensor, *, owned: bool = False) -> torch.Tensor:
        """A host copy of ``t`` (pinned when it comes from a GPU, for fast copies back);
        ``owned`` host tensors (fresh gathers) are returned as they are."""
        if t.device.type == "cpu":
            return t if owned else t.clone()
        return t.to("cpu", copy=True).pin_memory()

    def _check_length(self, request_id: str, new_len: int) -> None:
        if new_len > self.max_model_len:
            raise ValueError(
                f"request {request_id!r} would hold {new_len} tokens, over max_model_len "
                f"({self.max_model_len})"
            )
