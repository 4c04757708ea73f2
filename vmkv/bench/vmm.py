"""``vmkv bench vmm``: latency of the page operations, per page, for several page sizes.

Each page is created, mapped (one call per page, at shuffled physical offsets so runs never
merge), first touched (written once: where the host commits and zeroes memory), unmapped and
released. The host backend always runs; the CUDA backend runs when a GPU is present.
"""

from __future__ import annotations

import random
import time
from typing import Any

import numpy as np

from vmkv.memory import BackendUnavailable, MemoryBackend, create_backend

DEFAULT_PAGE_SIZES = (4 * 1024, 64 * 1024, 2 << 20)


def _pages_for(page_size: int, budget_bytes: int, cap: int) -> int:
    return max(8, min(cap, budget_bytes // page_size))


def measure(backend: MemoryBackend, num_pages: int, seed: int = 0) -> dict[str, Any]:
    """Create, map, touch, unmap and release ``num_pages`` pages one call at a time."""
    ps = backend.page_size
    base = backend.reserve(num_pages * ps)
    order = list(range(num_pages))
    random.Random(seed).shuffle(order)  # VA page i gets physical page order[i]
    touch_ns: list[int] = []
    try:
        for page in order:
            backend.create_page(page)
        for i, page in enumerate(order):
            backend.map_run(base + i * ps, page, 1)
        data = backend.as_tensor(base, num_pages * ps)
        for i in range(num_pages):
            start = time.perf_counter_ns()
            data[i * ps : (i + 1) * ps].fill_(1)
            backend.synchronize()
            touch_ns.append(time.perf_counter_ns() - start)
        del data
        backend.synchronize()
        for i in range(num_pages):
            backend.unmap_run(base + i * ps, 1)
        for page in order:
            backend.release_page(page)
    finally:
        backend.free_reservation(base, num_pages * ps)
    stats = backend.stats.as_dict()
    touch = np.array(touch_ns) / 1e3
    return {
        "page_size": ps,
        "pages": num_pages,
        **{f"{op}_p50_us": stats[op]["p50_us"] for op in ("create", "map", "unmap", "release")},
        **{f"{op}_p99_us": stats[op]["p99_us"] for op in ("create", "map", "unmap", "release")},
        "touch_p50_us": float(np.percentile(touch, 50)),
        "touch_p99_us": float(np.percentile(touch, 99)),
    }


def run(page_sizes: tuple[int, ...] = DEFAULT_PAGE_SIZES, devices: tuple[str, ...] = ("cpu",),
        budget_bytes: int = 256 << 20, max_pages: int = 2048) -> dict[str, Any]:
    """Measure every (device, page size); devices that are unavailable are reported, not run."""
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    for device in devices:
        for page_size in page_sizes:
            n = _pages_for(page_size, budget_bytes, max_pages)
            try:
                backend = create_backend(device, page_size, n)
            except BackendUnavailable as exc:
                skipped[device] = str(exc)
                break
            except ValueError as exc:  # e.g. a page size below the CUDA granularity
                skipped[f"{device}:{page_size}"] = str(exc)
                continue
            try:
                rows.append({"device": device, **measure(backend, n)})
            finally:
                backend.close()
    return {"rows": rows, "skipped": skipped}


COLUMNS = ("device", "page_size", "pages", "create_p50_us", "map_p50_us", "map_p99_us",
           "touch_p50_us", "unmap_p50_us", "unmap_p99_us", "release_p50_us")
