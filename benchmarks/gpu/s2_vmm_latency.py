"""Step 2: VMM call latency per 2 MiB page on this GPU (vattention.md §6: "vmkv must measure
this on H200"), on the engine thread and on a background thread while the GPU computes, and
the background mapper's stall (the time a step would wait for it).

Every call is one driver call through vmkv's CUDA backend plumbing; pages are mapped at
shuffled physical order (no merging), set-access per page vs one call per 64-page run.
"""

from __future__ import annotations

import random
import threading
import time

from common import Result, guard, percentiles_us, run_step

NUM_PAGES = 256


def main(res: Result) -> None:
    import torch

    from vmkv.memory.cuda import CudaMemoryBackend
    from vmkv.memory.mapper import BackgroundMapper

    backend = CudaMemoryBackend(None, 2 * NUM_PAGES)
    ps, call, acc = backend.page_size, backend._call, backend._access
    base = backend.reserve(2 * NUM_PAGES * ps)
    ptr = lambda i: backend._ptr(base + i * ps)  # noqa: E731
    order = list(range(NUM_PAGES))
    random.Random(0).shuffle(order)

    def timed(fn) -> int:  # type: ignore[no-untyped-def]
        t = time.perf_counter_ns()
        fn()
        return time.perf_counter_ns() - t

    lat: dict[str, list[int]] = {k: [] for k in (
        "create", "map", "set_access_1", "set_access_run64", "unmap", "release", "touch")}
    for p in range(NUM_PAGES):
        lat["create"].append(timed(lambda p=p: backend.create_page(p)))
    h = backend._handles
    for i, p in enumerate(order):
        lat["map"].append(timed(lambda i=i, p=p: call("cuMemMap", ptr(i), ps, 0, h[p], 0)))
    for i in range(NUM_PAGES):
        lat["set_access_1"].append(timed(lambda i=i: call("cuMemSetAccess", ptr(i), ps, [acc], 1)))
    data = backend.as_tensor(base, NUM_PAGES * ps)
    for i in range(NUM_PAGES):
        def touch(i: int = i) -> None:
            data[i * ps : (i + 1) * ps].fill_(1)
            torch.cuda.synchronize()
        lat["touch"].append(timed(touch))
    torch.cuda.synchronize()
    for i in range(NUM_PAGES):
        lat["unmap"].append(timed(lambda i=i: call("cuMemUnmap", ptr(i), ps)))
    for i, p in enumerate(order):  # map again, then set access on 64-page runs
        call("cuMemMap", ptr(i), ps, 0, h[p], 0)
    for r in range(NUM_PAGES // 64):
        lat["set_access_run64"].append(
            timed(lambda r=r: call("cuMemSetAccess", ptr(r * 64), 64 * ps, [acc], 1)))
    for i in range(NUM_PAGES):
        call("cuMemUnmap", ptr(i), ps)
    summary = {k: percentiles_us(v) for k, v in lat.items()}
    run = summary["set_access_run64"]
    summary["set_access_run64_per_page_us"] = run.get("p50_us", 0) / 64
    res.record("engine_thread", summary)
    res.check("map / set-access / unmap work on the engine thread", True,
              map_p50_us=summary["map"]["p50_us"], unmap_p50_us=summary["unmap"]["p50_us"])

    # -- the same calls from a background thread while the GPU is busy ------------------------
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def background() -> dict[str, object]:
        out: dict[str, list[int]] = {"map": [], "set_access_1": [], "unmap": []}
        errors: list[str] = []

        def worker() -> None:
            try:
                backend.bind_thread()
                for i, p in enumerate(order):
                    out["map"].append(timed(lambda i=i, p=p: call("cuMemMap", ptr(i), ps, 0,
                                                                     h[p], 0)))
                    out["set_access_1"].append(
                        timed(lambda i=i: call("cuMemSetAccess", ptr(i), ps, [acc], 1)))
            except Exception as exc:  # noqa: BLE001
                errors.append(repr(exc))

        thread = threading.Thread(target=worker, name="bg-mapper")
        thread.start()
        while thread.is_alive():  # keep the GPU busy meanwhile
            y = x @ x
            del y
        thread.join()
        torch.cuda.synchronize()
        data[: NUM_PAGES * ps].view(torch.int32)[::1024].fill_(7)  # usable from torch
        torch.cuda.synchronize()
        for i in range(NUM_PAGES):
            out["unmap"].append(timed(lambda i=i: call("cuMemUnmap", ptr(i), ps)))
        res.check("map + set-access from a background thread (context made current there)",
                  not errors, errors=errors[:3])
        return {k: percentiles_us(v) for k, v in out.items()}

    res.record("background_thread_gpu_busy", guard(res, "background thread", background))

    # -- the background mapper: stall per step while the GPU computes --------------------------
    def mapper_stall() -> dict[str, object]:
        mapper = BackgroundMapper(backend)
        pages_per_step, steps = 8, NUM_PAGES // 8
        done = 0
        for step in range(steps):
            for _ in range(3):  # ~ a decode step of GPU work
                y = x @ x
            first = step * pages_per_step

            def unit(first: int = first) -> None:
                for i in range(first, first + pages_per_step):
                    call("cuMemMap", ptr(i), ps, 0, h[order[i]], 0)
                call("cuMemSetAccess", ptr(first), pages_per_step * ps, [acc], 1)

            mapper.submit([unit])
            torch.cuda.synchronize()  # sampling syncs with the GPU
            mapper.wait()  # the next KV call
            done += pages_per_step
        del y
        stats = mapper.stats.as_dict()
        mapper.close()
        torch.cuda.synchronize()
        for i in range(done):
            call("cuMemUnmap", ptr(i), ps)
        res.check("mapper maps while the GPU computes; stall measured", stats["units"] == steps,
                  stall_ms=stats["stall_ms"], busy_ms=stats["busy_ms"])
        return stats

    res.record("mapper", guard(res, "mapper stall", mapper_stall))
    for p in range(NUM_PAGES):
        lat["release"].append(timed(lambda p=p: backend.release_page(p)))
    res.data["engine_thread"]["release"] = percentiles_us(lat["release"])
    res.flush()
    backend.free_reservation(base, 2 * NUM_PAGES * ps)
    s = res.data["engine_thread"]
    res.headline = (f"per 2 MiB: create {s['create']['p50_us']:.0f} us, map "
                    f"{s['map']['p50_us']:.1f} us, access {s['set_access_1']['p50_us']:.1f} us "
                    f"(64-run {s['set_access_run64_per_page_us']:.2f}/page), unmap "
                    f"{s['unmap']['p50_us']:.1f} us, release {s['release']['p50_us']:.0f} us")


if __name__ == "__main__":
    run_step("s2_vmm_latency", main)
