"""Background mapper: ordering, waiting without spinning, pause, errors, the never-unmap rule,
and a virtual KV cache growing on the host backend (real mmap) while the mapper pre-maps.

The KV side is the manager's mapping part (``kv.mapping.attach`` / ``kv.mapping.units``; see
docs/gpu.md).
"""

from __future__ import annotations

import functools
import threading
import time

import pytest
import torch

from vmkv.kv import KVSpec, VirtualKVCache
from vmkv.memory import PagePool, VirtualRegion, VmmError
from vmkv.memory.host import HostMemoryBackend
from vmkv.memory.mapper import BackgroundMapper

PAGE = 64 * 1024
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64)  # fp32 all-layers: 32 tokens per page

def kv_cache(num_pages: int = 96, slots: int = 8, layout: str = "all-layers",
             ) -> tuple[VirtualKVCache, HostMemoryBackend]:
    backend = HostMemoryBackend(PAGE, num_pages)
    kv = VirtualKVCache(SPEC, pool=PagePool(backend, num_pages), num_slots=slots,
                        max_model_len=1024, layout=layout)
    return kv, backend


# -- the mapper itself -------------------------------------------------------------------------
def test_units_run_in_order_on_the_thread_and_wait_measures_the_stall() -> None:
    mapper = BackgroundMapper(HostMemoryBackend(PAGE, 4))
    seen: list[tuple[int, str]] = []
    release = threading.Event()

    def unit(i: int) -> None:
        release.wait()
        time.sleep(0.02)
        seen.append((i, threading.current_thread().name))

    assert mapper.wait() == 0.0  # idle: no stall
    assert mapper.submit([functools.partial(unit, i) for i in range(3)]) == 3
    threading.Timer(0.2, release.set).start()  # the units run once wait() below is blocked
    stalled = mapper.wait()
    assert [i for i, _ in seen] == [0, 1, 2] and {n for _, n in seen} == {"vmkv-mapper"}
    assert stalled > 0.06  # at least the three 20 ms units ran while it waited
    s = mapper.stats
    assert (s.jobs, s.units, s.waits, s.stalled_waits) == (1, 3, 2, 1)
    assert s.stall_ns == s.max_stall_ns > 0 and s.busy_ns >= 0.06e9
    assert mapper.stats.as_dict()["stall_p50_us"] > 0
    mapper.close()


def test_an_idle_mapper_sleeps_instead_of_spinning() -> None:
    """The mapper thread's own CPU time (``time.thread_time`` read by units on that thread)
    stands still while it has no work: a spinning thread would burn what the OS gives it."""
    mapper = BackgroundMapper(HostMemoryBackend(PAGE, 4))
    cpu: list[float] = []
    mapper.submit([lambda: cpu.append(time.thread_time())])
    mapper.wait()
    time.sleep(0.5)  # idle
    mapper.submit([lambda: cpu.append(time.thread_time())])
    mapper.wait()
    used = cpu[1] - cpu[0]  # two waits and wake-ups, and the units themselves: microseconds
    assert used < 0.01, f"the idle mapper thread burnt {used:.3f} s of CPU in 0.5 s"
    mapper.close()
    assert not mapper._thread.is_alive()


def test_pause_drains_queued_work_then_drops_new_work() -> None:
    mapper = BackgroundMapper(HostMemoryBackend(PAGE, 4))
    done: list[int] = []
    mapper.submit([lambda: (time.sleep(0.05), done.append(1))])
    with mapper.paused():
        assert done == [1] and mapper.idle  # drained before the capture starts
        assert mapper.submit([lambda: done.append(2)]) == 0
        time.sleep(0.02)
        assert done == [1] and mapper.stats.units_dropped == 1
    mapper.submit([lambda: done.append(3)])
    mapper.wait()
    assert done == [1, 3]
    mapper.close()


def test_a_failing_unit_stops_its_work_and_is_raised_by_wait() -> None:
    mapper = BackgroundMapper(HostMemoryBackend(PAGE, 4))
    done: list[int] = []

    def boom() -> None:
        raise VmmError("cuMemMap failed: CUDA_ERROR_OUT_OF_MEMORY")

    mapper.submit([lambda: done.append(1), boom, lambda: done.append(2)])
    with pytest.raises(VmmError, match="CUDA_ERROR_OUT_OF_MEMORY"):
        mapper.wait()
    assert done == [1]
    mapper.wait()  # reported once
    mapper.close()


def test_a_unit_that_unmaps_is_an_error() -> None:
    backend = HostMemoryBackend(PAGE, 4)
    base = backend.reserve(2 * PAGE)
    backend.create_page(0)
    backend.map_run(base, 0, 1)
    mapper = BackgroundMapper(backend)
    mapper.submit([lambda: backend.unmap_run(base, 1)])
    with pytest.raises(VmmError, match="unmapped pages"):
        mapper.wait()
    mapper.close()
    backend.free_reservation(base, 2 * PAGE)
    backend.close()


def test_thread_init_runs_first_on_the_thread_and_its_failure_is_reported() -> None:
    names: list[str] = []
    mapper = BackgroundMapper(HostMemoryBackend(PAGE, 4),
                              thread_init=lambda: names.append(threading.current_thread().name))
    mapper.submit([lambda: names.append("unit")])
    mapper.wait()
    assert names == ["vmkv-mapper", "unit"]
    mapper.close()

    def no_context() -> None:
        raise RuntimeError("cuCtxSetCurrent failed: CUDA_ERROR_INVALID_CONTEXT")

    broken = BackgroundMapper(HostMemoryBackend(PAGE, 4), thread_init=no_context)
    broken._thread.join(timeout=5)
    with pytest.raises(VmmError, match="INVALID_CONTEXT"):
        broken.wait()
    with pytest.raises(VmmError, match="failed to start"):
        broken.submit([lambda: None])


# -- the KV hook on real host mappings ----------------------------------------------------------
class MapCalls:
    """Counts backend map calls per thread (wraps ``map_run``)."""

    def __init__(self, backend: HostMemoryBackend) -> None:
        self.by_thread: dict[str, int] = {}
        inner = backend.map_run

        def map_run(va: int, first: int, num: int) -> None:
            name = threading.current_thread().name
            self.by_thread[name] = self.by_thread.get(name, 0) + 1
            inner(va, first, num)

        backend.map_run = map_run  # type: ignore[method-assign]


def write_rows(kv: VirtualKVCache, rid: str, start: int, stop: int) -> None:
    """Fill rows ``[start, stop)`` of ``rid`` (every layer, K and V) with ``token + slot``."""
    slot = kv.slot(rid)
    for layer in range(SPEC.num_layers):
        for t in kv.layer_kv(layer):
            t[slot, start:stop] = (torch.arange(start, stop, dtype=torch.float32)
                                   + 1000 * slot).view(-1, 1, 1)


def check_rows(kv: VirtualKVCache, rid: str) -> None:
    slot, n = kv.slot(rid), kv.room.num_tokens(rid)
    want = (torch.arange(n, dtype=torch.float32) + 1000 * slot).view(-1, 1, 1)
    for layer in range(SPEC.num_layers):
        for t in kv.layer_kv(layer):
            assert torch.equal(t[slot, :n], want.expand(n, SPEC.num_kv_heads, SPEC.head_dim))


@pytest.mark.parametrize("layout", ["all-layers", "per-layer"])
def test_requests_grow_while_the_mapper_premaps(layout: str) -> None:
    kv, backend = kv_cache(num_pages=160 if layout == "per-layer" else 96, layout=layout)
    calls = MapCalls(backend)
    mapper = BackgroundMapper(backend)
    kv.mapping.attach(mapper)
    rids = [f"r{i}" for i in range(6)]
    first = 5 if layout == "all-layers" else 80  # every request crosses a page boundary
    for i, rid in enumerate(rids):
        n = first + 5 * i
        assert kv.allocate(rid, n)
        write_rows(kv, rid, 0, n)
    engine_maps_before = calls.by_thread.get("MainThread", 0)
    lookahead = 8
    for step in range(60):
        if step == 30:  # a request finishes; a new one arrives (deferred slot reuse)
            kv.free("r2")
            rids.remove("r2")
            assert kv.allocate("n0", 3)
            write_rows(kv, "n0", 0, 3)
            rids.append("n0")
        for rid in rids:  # the decode step: one token each
            n = kv.room.num_tokens(rid)
            assert kv.allocate(rid, 1)
            write_rows(kv, rid, n, n + 1)
        mapper.submit(kv.mapping.units(lookahead))  # the GPU would compute now
        time.sleep(0.002)
    kv.accounting.check()  # waits for the mapper, then every invariant (no leak, no alias...)
    for rid in rids:
        check_rows(kv, rid)
    engine_maps = calls.by_thread.get("MainThread", 0) - engine_maps_before
    mapper_maps = calls.by_thread.get("vmkv-mapper", 0)
    # every growth page came from the mapper except the new request's first one
    assert mapper_maps >= 6 and engine_maps <= kv.layout.num_regions, calls.by_thread
    assert backend.stats.ops["unmap"].calls == 0
    s = mapper.stats
    assert s.units >= mapper_maps // kv.layout.num_regions // 2 > 0
    assert s.waits > 60
    kv.close()
    mapper.close()


def test_premap_maps_only_free_pages_and_never_reclaims() -> None:
    kv, backend = kv_cache(num_pages=4, slots=4)
    mapper = BackgroundMapper(backend)
    kv.mapping.attach(mapper)
    assert kv.allocate("a", 60)  # 2 pages
    assert kv.allocate("b", 40)  # 2 pages: the pool is full
    kv.free("b")  # b's slot keeps its 2 pages (deferred): reclaimable, not free
    assert kv.pool.num_free == 0
    mapper.submit(kv.mapping.units(64))
    mapper.wait()
    assert kv.mapped_pages(kv.slot("a")) == 2 and kv.accounting.usage.bytes_held == 4 * PAGE
    assert backend.stats.ops["unmap"].calls == 0
    assert kv.allocate("a", 10)  # the engine thread reclaims b's idle pages itself
    assert kv.mapped_pages(kv.slot("a")) == 3
    kv.accounting.check()
    kv.close()
    mapper.close()


def test_premap_units_are_skipped_for_requests_gone_before_they_run() -> None:
    kv, backend = kv_cache()
    mapper = BackgroundMapper(backend)
    assert kv.allocate("a", 30) and kv.allocate("b", 30)
    units = kv.mapping.units(30)  # both need a second page (60 tokens)
    assert len(units) == 2
    kv.free("a")
    assert [u() for u in units] == [0, 1]  # a is gone: nothing mapped for it
    kv.mapping.attach(mapper)
    assert kv.mapped_pages(kv.slot("b")) == 2
    kv.accounting.check()
    kv.close()
    mapper.close()


def test_kv_calls_wait_for_running_units() -> None:
    kv, backend = kv_cache()
    mapper = BackgroundMapper(backend)
    kv.mapping.attach(mapper)
    assert kv.allocate("a", 30)
    started = threading.Event()
    order: list[str] = []

    def slow_unit() -> None:
        started.set()
        time.sleep(0.1)
        order.append("unit done")

    mapper.submit([slow_unit, *kv.mapping.units(40)])
    started.wait()
    assert kv.room.num_tokens("a") == 30  # plain reads do not wait
    assert kv.allocate("a", 10)  # waits for both units, then finds the page mapped
    order.append("allocated")
    assert order == ["unit done", "allocated"]
    assert mapper.stats.stalled_waits >= 1 and mapper.stats.units == 2
    assert backend.stats.ops["map"].calls == 2  # a's first page, then the mapper's
    kv.close()
    mapper.close()


def test_prefix_cache_calls_wait_for_running_units() -> None:
    """match_prefix maps cached pages into a slot and cache_computed takes page references:
    neither may run beside the mapper thread."""
    backend = HostMemoryBackend(PAGE, 96)
    kv = VirtualKVCache(SPEC, pool=PagePool(backend, 96), num_slots=8, max_model_len=1024,
                        enable_prefix_caching=True)
    mapper = BackgroundMapper(backend)
    kv.mapping.attach(mapper)
    started = threading.Event()

    def slow_unit() -> None:
        started.set()
        time.sleep(0.1)

    tokens = list(range(100))
    for call in (lambda: kv.prefix.match("a", tokens),
                 lambda: kv.prefix.publish("a", tokens, 60)):
        started.clear()
        mapper.submit([slow_unit])
        started.wait()
        waited = mapper.stats.stalled_waits
        call()
        assert mapper.stats.stalled_waits == waited + 1
        if not kv.room.holds("a"):
            assert kv.allocate("a", 100)
    kv.accounting.check()
    kv.close()
    mapper.close()


# -- the CUDA backend wraps reserved VA before anything is mapped (fake driver: no GPU here) -----
def test_cuda_as_tensor_anchors_an_unmapped_base_for_the_wrap() -> None:
    """torch asks the driver which device owns a pointer; unmapped VA belongs to none. The
    fake driver stands in for the GPU driver (none exists on CI) and ``_wrap`` for torch's
    pointer query: it fails unless ``base`` is mapped with access."""
    from fake_cuda_driver import FakeDriver

    from vmkv.memory.cuda import CudaMemoryBackend

    class QueryingBackend(CudaMemoryBackend):
        seen: list[tuple[int, bool]] = []

        def _wrap(self, base: int, nbytes: int) -> torch.Tensor:
            mapped = base in self.cu.maps and base in self.cu.accessible
            self.seen.append((base, mapped))
            if not mapped:
                raise RuntimeError("CUDA error: invalid argument (cudaPointerGetAttributes)")
            return torch.empty(nbytes, dtype=torch.uint8, device="meta")

        def synchronize(self) -> None:  # no device to wait for
            pass

    gran = 2 << 20
    backend = QueryingBackend(None, 8, 0, driver=FakeDriver(gran))
    drv = backend.cu
    base = backend.reserve(4 * gran)
    t = backend.as_tensor(base, 4 * gran)
    assert t.numel() == 4 * gran and backend.seen == [(base, False), (base, True)]
    assert not drv.maps and not drv.handles  # the anchor is unmapped and released again
    assert drv.calls[-5:] == ["cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap",
                              "cuMemRelease"]
    pool = PagePool(backend, 8)
    region = VirtualRegion(pool, 4 * gran)
    region.map_new(0, 1)  # a mapped base wraps directly, no anchor
    backend.seen.clear()
    region.as_bytes()
    assert backend.seen == [(region.base, True)]
    with pytest.raises(RuntimeError, match="invalid argument"):
        backend.as_tensor(base + 4096, gran)  # not page-aligned: no anchor, the error stays
    region.close()
    pool.release_all_idle()
    backend.free_reservation(base, 4 * gran)
    assert not drv.maps and not drv.handles
