"""Step 2: VMM call latency per 2 MiB page on this GPU (vattention.md §6: "vmkv must measure
this on H200"), on the engine thread and on a background thread while the GPU computes, and
the background mapper's stall (the time a step would wait for it).

Every call is one driver call through vmkv's CUDA backend plumbing; pages are mapped at
shuffled physical order (no merging), set-access per page vs one call per 64-page run. A CPU
dry run times the host backend's mmap calls instead (32 pages of 64 KiB; mapping includes
access there, so set-access is n/a).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

from common import (
    DEVICE,
    NA_CPU,
    ON_CPU,
    Result,
    guard,
    memory_backend,
    percentiles_us,
    run_step,
    sync,
)

NUM_PAGES = 32 if ON_CPU else 256
RUN = 8 if ON_CPU else 64  # pages per set-access run


class Calls:
    """Single VMM calls at page ``i`` of one reservation: the CUDA driver's, or the host's
    (map = mmap with access, no separate set-access)."""

    def __init__(self, backend: Any, base: int) -> None:
        self.backend, self.base, self.ps = backend, base, backend.page_size

    def map(self, i: int, page: int) -> None:
        b = self.backend
        if ON_CPU:
            b.map_run(self.base + i * self.ps, page, 1)
        else:
            b._call("cuMemMap", b._ptr(self.base + i * self.ps), self.ps, 0, b._handles[page], 0)

    def access(self, i: int, n: int = 1) -> None:
        b = self.backend
        if not ON_CPU:
            b._call("cuMemSetAccess", b._ptr(self.base + i * self.ps), n * self.ps, [b._access],
                    1)

    def unmap(self, i: int) -> None:
        b = self.backend
        if ON_CPU:
            b.unmap_run(self.base + i * self.ps, 1)
        else:
            b._call("cuMemUnmap", b._ptr(self.base + i * self.ps), self.ps)


def timed(fn: Callable[[], Any]) -> int:
    t = time.perf_counter_ns()
    fn()
    return time.perf_counter_ns() - t


def engine_thread(res: Result, backend: Any, calls: Calls, order: list[int]) -> Any:
    """Create, map, set-access, first touch, unmap on this thread; returns the tensor view."""
    lat: dict[str, list[int]] = {k: [] for k in (
        "create", "map", "set_access_1", "set_access_run", "unmap", "touch")}
    for p in range(NUM_PAGES):
        lat["create"].append(timed(lambda p=p: backend.create_page(p)))
    for i, p in enumerate(order):
        lat["map"].append(timed(lambda i=i, p=p: calls.map(i, p)))
    for i in range(NUM_PAGES):
        lat["set_access_1"].append(timed(lambda i=i: calls.access(i)))
    ps = backend.page_size
    data = backend.as_tensor(calls.base, NUM_PAGES * ps)
    for i in range(NUM_PAGES):
        def touch(i: int = i) -> None:
            data[i * ps : (i + 1) * ps].fill_(1)
            sync()
        lat["touch"].append(timed(touch))
    sync()
    for i in range(NUM_PAGES):
        lat["unmap"].append(timed(lambda i=i: calls.unmap(i)))
    for i, p in enumerate(order):  # map again, then set access on runs of RUN pages
        calls.map(i, p)
    for r in range(NUM_PAGES // RUN):
        lat["set_access_run"].append(timed(lambda r=r: calls.access(r * RUN, RUN)))
    for i in range(NUM_PAGES):
        calls.unmap(i)
    summary: dict[str, Any] = {k: percentiles_us(v) for k, v in lat.items()}
    summary["set_access_run_pages"] = RUN
    summary["set_access_run_per_page_us"] = summary["set_access_run"].get("p50_us", 0) / RUN
    if ON_CPU:
        for key in ("set_access_1", "set_access_run", "set_access_run_per_page_us"):
            summary[key] = NA_CPU
    res.record("engine_thread", summary)
    res.check("map / set-access / unmap work on the engine thread", True,
              map_p50_us=summary["map"]["p50_us"], unmap_p50_us=summary["unmap"]["p50_us"])
    return data


def background(res: Result, backend: Any, calls: Calls, order: list[int], data: Any,
               busy: Callable[[], None]) -> dict[str, Any]:
    """The same map + set-access calls from another thread while the device is busy; the
    pages are touched afterwards only if every call succeeded."""
    import torch

    out: dict[str, list[int]] = {"map": [], "set_access_1": [], "unmap": []}
    errors: list[str] = []
    mapped: list[int] = []

    def worker() -> None:
        try:
            backend.bind_thread()
            for i, p in enumerate(order):
                out["map"].append(timed(lambda i=i, p=p: calls.map(i, p)))
                mapped.append(i)
                out["set_access_1"].append(timed(lambda i=i: calls.access(i)))
        except Exception as exc:  # noqa: BLE001
            errors.append(repr(exc))

    thread = threading.Thread(target=worker, name="bg-mapper")
    thread.start()
    while thread.is_alive():  # keep the device busy meanwhile
        busy()
    thread.join()
    sync()
    res.check("map + set-access from a background thread (context made current there)",
              not errors, errors=errors[:3])
    ps = backend.page_size
    if errors:
        res.record("background_fill", f"skipped: the background thread failed after mapping "
                   f"{len(mapped)} of {NUM_PAGES} pages ({errors[0][:200]})")
    else:
        data[: NUM_PAGES * ps].view(torch.int32)[::1024].fill_(7)  # usable from torch
        sync()
        res.record("background_fill", "done")
    for i in mapped:
        out["unmap"].append(timed(lambda i=i: calls.unmap(i)))
    summary: dict[str, Any] = {k: percentiles_us(v) for k, v in out.items()}
    if ON_CPU:
        summary["set_access_1"] = NA_CPU
    return summary


def mapper_stall(res: Result, backend: Any, calls: Calls, order: list[int],
                 busy: Callable[[], None]) -> dict[str, Any]:
    """The background mapper maps 8 pages per step while the device computes; the engine's
    wait is the stall."""
    from vmkv.memory.mapper import BackgroundMapper

    mapper = BackgroundMapper(backend)
    pages_per_step, steps = 8, NUM_PAGES // 8
    mapped: list[int] = []
    try:
        for step in range(steps):
            for _ in range(3):  # ~ a decode step of GPU work
                busy()
            first = step * pages_per_step

            def unit(first: int = first) -> None:
                for i in range(first, first + pages_per_step):
                    calls.map(i, order[i])
                    mapped.append(i)
                calls.access(first, pages_per_step)

            mapper.submit([unit])
            sync()  # sampling syncs with the GPU
            mapper.wait()  # the next KV call
        stats = mapper.stats.as_dict()
    finally:
        mapper.close()
        sync()
        for i in mapped:
            calls.unmap(i)
    res.check("mapper maps while the GPU computes; stall measured", stats["units"] == steps,
              stall_ms=stats["stall_ms"], busy_ms=stats["busy_ms"])
    return stats


def main(res: Result) -> None:
    import torch

    backend = memory_backend(2 * NUM_PAGES)
    ps = backend.page_size
    base = backend.reserve(2 * NUM_PAGES * ps)
    calls = Calls(backend, base)
    order = list(range(NUM_PAGES))
    random.Random(0).shuffle(order)
    data = engine_thread(res, backend, calls, order)
    size = 128 if ON_CPU else 8192
    x = torch.randn(size, size, device=DEVICE, dtype=torch.bfloat16)
    busy = lambda: x @ x  # noqa: E731
    res.record("background_thread_gpu_busy", guard(
        res, "background thread", lambda: background(res, backend, calls, order, data, busy)))
    res.record("mapper", guard(res, "mapper stall",
                               lambda: mapper_stall(res, backend, calls, order, busy)))
    release = [timed(lambda p=p: backend.release_page(p)) for p in range(NUM_PAGES)]
    res.data["engine_thread"]["release"] = percentiles_us(release)
    res.flush()
    backend.free_reservation(base, 2 * NUM_PAGES * ps)
    backend.close()
    s = res.data["engine_thread"]
    access = ("n/a" if ON_CPU else f"{s['set_access_1']['p50_us']:.1f} us (run of {RUN} "
              f"{s['set_access_run_per_page_us']:.2f}/page)")
    res.headline = (f"per {ps >> 10} KiB page: create {s['create']['p50_us']:.0f} us, map "
                    f"{s['map']['p50_us']:.1f} us, access {access}, unmap "
                    f"{s['unmap']['p50_us']:.1f} us, release {s['release']['p50_us']:.0f} us")


if __name__ == "__main__":
    run_step("s2_vmm_latency", main)
