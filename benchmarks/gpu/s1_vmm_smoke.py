"""Step 1: VMM smoke test through vmkv's CUDA backend (gpu.md §4 pitfalls 6, 7, 10, 11).

reserve 64 GiB -> create + map 2 pages -> wrap as a torch tensor -> torch writes -> read back
through cupy (a second path: the context-mismatch check) -> cupy writes, torch reads -> map a
third page under the already-wrapped tensor -> map it again at a fourth VA (sharing) -> unmap
after synchronize, release, free.
"""

from __future__ import annotations

from common import Result, guard, run_step


def main(res: Result) -> None:
    import numpy as np
    import torch

    from vmkv.memory import PagePool, VirtualRegion
    from vmkv.memory.cuda import CudaMemoryBackend

    backend = CudaMemoryBackend(None, 8)
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
    torch.cuda.synchronize()
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
    torch.cuda.synchronize()
    seen = float(alias.sum()) == 1.5 * alias.numel()
    alias.fill_(4.0)
    res.check("one page at two VAs: each address sees the other's writes",
              seen and float(third.sum()) == 4.0 * third.numel())
    backend.synchronize()
    region.unmap(0, 4)
    res.check("unmap after synchronize", region.num_mapped == 0)
    region.close()
    pool.release_all_idle()
    res.check("every handle released", all(h is None for h in backend._handles))

    def big_reservation() -> None:
        size = 4 << 40  # 4 TiB (gpu.md pitfall 10)
        base = backend.reserve(size)
        backend.free_reservation(base, size)
        res.check("reserve + free 4 TiB of VA", True, base=hex(base))

    guard(res, "reserve 4 TiB", big_reservation)

    def wrap_unmapped() -> None:  # VirtualKVCache wraps its regions before mapping anything
        base = backend.reserve(4 * ps)
        try:
            try:
                t = backend._wrap(base, 4 * ps)  # torch alone: does it accept unmapped VA?
                res.record("plain_wrap_of_unmapped_va", f"accepted ({t.device})")
            except Exception as exc:  # noqa: BLE001 - a fact to record
                res.record("plain_wrap_of_unmapped_va", f"refused: {type(exc).__name__}: "
                           f"{str(exc)[:200]}")
            t = backend.as_tensor(base, 4 * ps)  # vmkv: anchors a scratch page if refused
            res.check("as_tensor of an unmapped reservation (anchor page if needed)",
                      t.data_ptr() == base and t.device == backend.device, device=str(t.device))
            pool2 = PagePool(backend, 2)
            region2 = VirtualRegion(pool2, 4 * ps, name="late")
            view = region2.as_bytes()  # wrapped before any page is mapped
            region2.map_new(1, 1)
            page = view[ps : 2 * ps].view(torch.float32)
            page.fill_(2.0)
            res.check("tensor wrapped before mapping reads a page mapped later",
                      float(page.sum()) == 2.0 * page.numel())
            backend.synchronize()
            region2.close()
            pool2.release_all_idle()
        finally:
            backend.free_reservation(base, 4 * ps)

    guard(res, "wrap unmapped VA", wrap_unmapped)
    backend.close()
    res.headline = "VMM map/wrap/torch/cupy " + ("ok" if res.ok else "FAILED")


if __name__ == "__main__":
    run_step("s1_vmm_smoke", main)
