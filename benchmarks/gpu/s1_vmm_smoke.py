"""Step 1: VMM smoke test through vmkv's CUDA backend (gpu.md §4 pitfalls 6, 7, 10, 11, 12).

reserve 64 GiB -> create + map 2 pages -> wrap as a torch tensor -> torch writes -> read back
through cupy (a second path: the context-mismatch check) -> cupy writes, torch reads -> map a
third page under the already-wrapped tensor -> map it again at a fourth VA (sharing) -> unmap
after synchronize, release, free. Then: a 4 TiB reservation, wrapping unmapped VA (torch's plain
wrap, vmkv's anchored wrap), and a Triton launch whose tensor argument's base is unmapped.
A CPU dry run does the same on the host backend (mmap); cupy and torch's wrap are n/a there.
"""

from __future__ import annotations

from typing import Any

from common import DEVICE, NA_CPU, ON_CPU, Result, guard, memory_backend, run_step, sync

PAGE = 2 << 20  # host pages of the dry run: the CUDA granularity


def round_trip(res: Result, backend: Any) -> None:
    """Map, wrap, write and read through torch (and cupy), share a page at a second VA."""
    import numpy as np
    import torch

    from vmkv.memory import PagePool, VirtualRegion

    ps = backend.page_size
    pool = PagePool(backend, 8)
    region = VirtualRegion(pool, 64 << 30, name="smoke")  # 64 GiB reserved
    res.record("reserved_base", hex(region.base))
    region.map_new(0, 2)
    data = region.as_bytes()[: 2 * ps].view(torch.int32)  # [2 pages of int32]
    n = data.numel()
    res.check("tensor aliases the VA (zero-copy)", data.data_ptr() == region.base,
              ptr=hex(data.data_ptr()), device=str(data.device))
    data.copy_(torch.arange(n, dtype=torch.int32, device=backend.device))
    sync()
    expect = np.arange(n, dtype=np.int64)
    res.check("torch write, torch read", int(data.long().sum()) == int(expect.sum()))

    def cupy_path() -> None:
        import cupy

        mem = cupy.cuda.UnownedMemory(region.base, 2 * ps, owner=None,
                                      device_id=backend.device.index)
        arr = cupy.ndarray((n,), dtype=cupy.int32, memptr=cupy.cuda.MemoryPointer(mem, 0))
        host = cupy.asnumpy(arr)
        res.check("cupy reads what torch wrote (same context, same memory)",
                  bool((host == expect).all()), first=host[:4].tolist())
        arr *= 2
        cupy.cuda.Device(backend.device.index).synchronize()
        res.check("torch reads what cupy wrote", int(data[-1]) == 2 * (n - 1),
                  last=int(data[-1]))

    if ON_CPU:
        res.record("cupy_round_trip", NA_CPU)
    else:
        guard(res, "cupy round trip", cupy_path)

    region.map_new(2, 1)  # a page mapped under the tensor created earlier
    third = region.as_bytes()[2 * ps : 3 * ps].view(torch.float32)
    third.fill_(1.5)
    res.check("a page mapped after wrapping is usable through the old tensor",
              float(third.sum()) == 1.5 * third.numel())
    # prefix caching / fork: one physical page mapped at a second VA (cuMemMap of one handle
    # twice); writes through either address are seen through the other
    region.map_shared(3, [int(region.page_at[2])])
    alias = region.as_bytes()[3 * ps : 4 * ps].view(torch.float32)
    sync()
    seen = float(alias.sum()) == 1.5 * alias.numel()
    alias.fill_(4.0)
    res.check("one page at two VAs: each address sees the other's writes",
              seen and float(third.sum()) == 4.0 * third.numel())
    backend.synchronize()
    region.unmap(0, 4)
    res.check("unmap after synchronize", region.num_mapped == 0)
    region.close()
    pool.release_all_idle()


def big_reservation(res: Result, backend: Any) -> None:
    """Reserve and free 4 TiB of VA (gpu.md pitfall 10)."""
    size = 4 << 40
    base = backend.reserve(size)
    backend.free_reservation(base, size)
    res.check("reserve + free 4 TiB of VA", True, base=hex(base))


def wrap_unmapped(res: Result, backend: Any) -> None:
    """VirtualKVCache wraps its regions before mapping anything: does torch accept unmapped
    VA, does vmkv's anchored wrap work, does an early tensor read pages mapped later?"""
    import torch

    from vmkv.memory import PagePool, VirtualRegion

    ps = backend.page_size
    base = backend.reserve(4 * ps)
    try:
        if ON_CPU:
            res.record("plain_wrap_of_unmapped_va", NA_CPU)
        else:
            try:
                t = backend._wrap(base, 4 * ps)  # torch alone: does it accept unmapped VA?
                res.record("plain_wrap_of_unmapped_va", f"accepted ({t.device})")
            except Exception as exc:  # noqa: BLE001 - a fact to record
                res.record("plain_wrap_of_unmapped_va", f"refused: {type(exc).__name__}: "
                           f"{str(exc)[:200]}")
        t = backend.as_tensor(base, 4 * ps)  # vmkv: anchors a scratch page if refused
        res.check("as_tensor of an unmapped reservation (anchor page if needed)",
                  t.data_ptr() == base and t.device == backend.device, device=str(t.device))
        pool = PagePool(backend, 2)
        region = VirtualRegion(pool, 4 * ps, name="late")
        view = region.as_bytes()  # wrapped before any page is mapped
        region.map_new(1, 1)
        page = view[ps : 2 * ps].view(torch.float32)
        page.fill_(2.0)
        res.check("tensor wrapped before mapping reads a page mapped later",
                  float(page.sum()) == 2.0 * page.numel())
        backend.synchronize()
        region.close()
        pool.release_all_idle()
    finally:
        backend.free_reservation(base, 4 * ps)


def triton_unmapped_base(res: Result) -> None:
    """A Triton kernel writes one element inside a mapped page, given a tensor whose base (its
    data_ptr) is an unmapped page. Triton's launcher checks every pointer argument with
    cuPointerGetAttribute; expected: "ValueError: Pointer argument (at 0) cannot be accessed
    from Triton (cpu tensor?)". A control launch passes the mapped page itself."""
    import torch
    import triton_probe

    backend = memory_backend(1, PAGE)
    ps = backend.page_size
    base = backend.reserve(2 * ps)
    backend.create_page(0)
    backend.map_run(base + ps, 0, 1)  # page 0 unmapped, page 1 mapped
    try:
        t = backend.as_tensor(base, 2 * ps).view(torch.float32)  # anchored wrap on CUDA
        mapped = t[ps // 4 :]
        index = ps // 4 + 7  # element 7 of the mapped page, counted from the unmapped base
        control = triton_probe.outcome(lambda: triton_probe.store_one(mapped, 3, 1.0))
        sync()
        res.check("Triton launch on a tensor based in a mapped page",
                  control == "ok" and float(mapped[3]) == 1.0, result=control[:300])
        result = triton_probe.outcome(lambda: triton_probe.store_one(t, index, 42.0))
        sync()
        if result == "ok":
            result = f"ok: launched, element reads {float(t[index])} (42.0 written)"
        res.record("triton_launch_unmapped_base", {"mode": triton_probe.mode(),
                                                   "device": DEVICE, "result": result})
        print(f"[s1_vmm_smoke] Triton launch with an unmapped base: {result}", flush=True)
    finally:
        backend.synchronize()
        backend.unmap_run(base + ps, 1)
        backend.release_page(0)
        backend.free_reservation(base, 2 * ps)
        backend.close()


def main(res: Result) -> None:
    backend = memory_backend(8, PAGE)
    guard(res, "VMM round trip", lambda: round_trip(res, backend))
    held = backend.file_bytes() if ON_CPU else sum(h is not None for h in backend._handles)
    res.check("every page released", held == 0, held=held)
    guard(res, "reserve 4 TiB", lambda: big_reservation(res, backend))
    guard(res, "wrap unmapped VA", lambda: wrap_unmapped(res, backend))
    backend.close()
    guard(res, "Triton launch with an unmapped base", lambda: triton_unmapped_base(res))
    res.headline = ("VMM map/wrap/torch" + ("" if ON_CPU else "/cupy") + " "
                    + ("ok" if res.ok else "FAILED"))


if __name__ == "__main__":
    run_step("s1_vmm_smoke", main)
