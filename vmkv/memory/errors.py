"""What the memory layer raises (a leaf: the backends, the failpoints and the KV managers
import it, it imports nothing of vmkv)."""

from __future__ import annotations


class VmmError(RuntimeError):
    """Base class for errors raised by the memory layer (an OS or driver call failed)."""


class BackendUnavailable(VmmError):
    """The backend cannot run here (no driver, no GPU, missing bindings)."""


class MappingBudgetExceeded(VmmError):
    """A mapping would exceed a budget (host: the VMA budget under ``vm.max_map_count``).

    KV managers treat it like an out-of-pages condition: they answer "cannot" so the scheduler
    can preempt, instead of letting the kernel refuse the mapping later.
    """


class MemoryStateLost(RuntimeError):
    """Undoing a failed operation failed too (the OS or driver refused even the rollback), so
    the mapping table may no longer match what is mapped. Not a :class:`VmmError` on purpose:
    nobody may treat it as one request's failure; the engine stops instead."""
