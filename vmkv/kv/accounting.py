"""What a KV manager holds, reported: usage, capacity, the start-up line, the memory backend's
counters, the mapping (VMA) budget; and the check that the accounting is exact."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass


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


class KVAccounting(ABC):
    """The usage and reports of one KV manager (start-up report, metrics, benchmarks, tests)."""

    @property
    @abstractmethod
    def usage(self) -> KVUsage:
        """Exact accounting of the memory the manager holds now."""

    @property
    @abstractmethod
    def capacity_tokens(self) -> int:
        """Tokens that fit in the physical budget (the startup report's "KV cache size")."""

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

    @abstractmethod
    def check(self) -> None:
        """Raise AssertionError if the accounting is inconsistent (tests call this)."""
