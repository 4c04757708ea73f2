"""Memory layer: reserve virtual ranges, map physical pages under them on demand.

``memory`` knows pages and addresses, never requests: see :mod:`vmkv.kv` for that.
"""

from vmkv.memory.base import MemoryBackend
from vmkv.memory.errors import (
    BackendUnavailable,
    MappingBudgetExceeded,
    MemoryStateLost,
    VmmError,
)
from vmkv.memory.pool import PagePool
from vmkv.memory.region import VirtualRegion

__all__ = [
    "BackendUnavailable",
    "MappingBudgetExceeded",
    "MemoryBackend",
    "MemoryStateLost",
    "PagePool",
    "VirtualRegion",
    "VmmError",
    "create_backend",
    "default_vma_budget",
]

HOST_DEFAULT_PAGE_SIZE = 64 * 1024  # no huge pages for shared memory here; 64 KiB is a good middle


def create_backend(device: str, page_size: int | None, max_pages: int) -> MemoryBackend:
    """The backend for ``device`` ("cpu" -> host mmap/memfd, "cuda[:i]" -> CUDA VMM)."""
    if device == "cpu":
        from vmkv.memory.host import HostMemoryBackend

        return HostMemoryBackend(page_size or HOST_DEFAULT_PAGE_SIZE, max_pages)
    if device.startswith("cuda"):
        from vmkv.memory.cuda import CudaMemoryBackend

        return CudaMemoryBackend(page_size, max_pages, device)
    raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")


def default_vma_budget(backend: MemoryBackend) -> int | None:
    """VMA budget of the regions on ``backend``: on the host, what keeps the process under 3/4
    of ``vm.max_map_count`` with the VMAs it already has; None (no budget) on CUDA."""
    if backend.name != "host":
        return None
    from vmkv.memory.host import current_vma_count, max_map_count

    return max(64, max_map_count() * 3 // 4 - current_vma_count())
