"""CUDA VMM backend: clean failure without a driver, the driver's rules (against a fake driver,
since no GPU exists on CI), and real mapping on a GPU (``gpu`` marker)."""

from __future__ import annotations

import threading

import pytest
import torch
from fake_cuda_driver import CUresult, FakeDriver
from skip_policy import cpu_only

from vmkv.config import CacheConfig
from vmkv.kv import KVSpec, VirtualKVCache, create_kv_cache
from vmkv.memory import BackendUnavailable, PagePool, VirtualRegion, VmmError
from vmkv.memory.cuda import CudaMemoryBackend
from vmkv.memory.mapper import BackgroundMapper

GRAN = 2 << 20


class MetaCudaBackend(CudaMemoryBackend):
    """The real backend on the fake driver; data views are meta tensors (no device memory)."""

    def as_tensor(self, base: int, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device="meta")

    def synchronize(self) -> None:
        self.cu.calls.append("synchronize")


def fake_backend(max_pages: int = 64, page_size: int | None = None) -> MetaCudaBackend:
    return MetaCudaBackend(page_size, max_pages, 0, driver=FakeDriver(GRAN))


@cpu_only
def test_without_a_driver_construction_fails_clearly() -> None:
    with pytest.raises(BackendUnavailable, match="^CUDA VMM unavailable: "):
        CudaMemoryBackend(None, 4)
    with pytest.raises(BackendUnavailable, match="CUDA VMM unavailable"):
        create_kv_cache(CacheConfig(), KVSpec(2, 2, 64), num_slots=2, max_model_len=64,
                        device="cuda")


def test_page_size_must_be_a_multiple_of_the_granularity() -> None:
    assert fake_backend().page_size == GRAN  # None -> the driver's minimum granularity
    assert fake_backend(page_size=2 * GRAN).page_size == 2 * GRAN
    with pytest.raises(ValueError, match=f"granularity \\({GRAN} B\\), got {GRAN // 2}"):
        fake_backend(page_size=GRAN // 2)


def test_map_is_per_page_access_per_run_unmap_exact() -> None:
    backend = fake_backend()
    drv = backend.cu
    pool = PagePool(backend, 16)
    region = VirtualRegion(pool, 8 * GRAN)
    drv.calls.clear()
    region.map_new(0, 3)
    assert drv.calls == ["cuMemCreate"] * 3 + ["cuMemMap"] * 3 + ["cuMemSetAccess"]
    assert len(drv.maps) == 3 and all(s == GRAN for s, _ in drv.maps.values())
    assert len(drv.accessible) == 3
    drv.calls.clear()
    region.unmap(1, 2)  # a sub-range of the run: fine, since every page was its own map call
    assert drv.calls == ["cuMemUnmap"] * 2
    pool.release_all_idle()
    assert drv.calls[-2:] == ["cuMemRelease"] * 2
    region.close()
    pool.release_all_idle()
    assert not drv.maps and not drv.handles and not drv.reservations


def test_a_refused_release_in_a_run_leaves_the_whole_run_idle() -> None:
    """A trim releases adjacent idle pages as one run; where the driver can only release one
    handle per call, a refusal part-way re-creates what the run had released (all or none),
    so the pool's accounting stays exact and the next trim returns them."""
    backend = fake_backend()
    pool = PagePool(backend, 16, max_idle_pages=0)
    region = VirtualRegion(pool, 8 * GRAN)
    region.map_new(0, 4)
    region.unmap(0, 4)
    backend.faults.arm("release", "ENOMEM", after=2)
    backend.cu.calls.clear()
    assert pool.trim() == 0
    assert backend.cu.calls == ["cuMemRelease"] * 2 + ["cuMemCreate"] * 2  # rolled back
    assert pool.num_idle == pool.num_created == 4 and len(backend.cu.handles) == 4
    pool.check()
    assert pool.trim() == 4 and pool.num_created == 0 and not backend.cu.handles
    region.close()


def test_driver_errors_carry_the_cuda_error_name() -> None:
    backend = MetaCudaBackend(None, 8, 0, driver=FakeDriver(GRAN, memory_bytes=2 * GRAN))
    pool = PagePool(backend, 8)
    region = VirtualRegion(pool, 8 * GRAN)
    region.map_new(0, 2)
    with pytest.raises(VmmError, match="cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY"):
        region.map_new(2, 1)
    assert pool.num_in_use == 2 and region.num_mapped == 2  # nothing half-done
    pool.check()
    with pytest.raises(VmmError, match="cuMemUnmap failed: CUDA_ERROR_INVALID_VALUE"):
        backend.unmap_run(region.va_of(5), 1)  # a page never mapped


def test_virtual_kv_cache_obeys_the_driver_rules() -> None:
    """The whole manager (grow, fork, copy-on-write, reclaim, free) over the fake driver."""
    spec = KVSpec(num_layers=4, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16)
    backend = fake_backend(max_pages=24)
    drv = backend.cu
    pool = PagePool(backend, 24)
    kv = VirtualKVCache(spec, pool=pool, num_slots=4, max_model_len=8192)
    row = spec.bytes_per_token  # all-layers: 4096 B per token, 512 tokens per 2 MiB page
    assert kv.layout.row_bytes == row and kv.layout.tokens_in(1) == 512
    assert kv.allocate("a", 700)  # 2 pages
    assert kv.fork("a", "b")  # shares both pages
    assert pool.ref_cnt[int(kv.regions[0].page_at[kv.slot("b") * kv.layout.slot_pages])] == 2
    drv.calls.clear()
    assert kv.allocate("b", 1)  # writes into the shared second page: copy-on-write
    assert drv.calls.index("synchronize") < drv.calls.index("cuMemUnmap")
    kv.accounting.check()
    assert kv.allocate("c", 8192)  # 16 pages
    assert not kv.allocate("d", 8192)  # 16 more do not fit: "cannot"
    kv.free("c")  # deferred: the slot keeps its 16 pages mapped
    assert pool.num_in_use == 3 + 16  # a: 2, b: its copy (page 0 is shared), c's slot: 16
    usage = kv.accounting.usage
    assert usage.bytes_in_use == 3 * GRAN and usage.bytes_held == 19 * GRAN
    drv.calls.clear()
    assert kv.allocate("d", 8192)  # best fit: takes c's slot, no driver call at all
    assert drv.calls == []
    kv.accounting.check()
    for rid in ("a", "b", "d"):
        kv.free(rid)
    kv.close()
    backend.close()
    assert not drv.maps and not drv.handles and not drv.reservations


def test_the_mapper_thread_binds_the_device_context_before_its_first_unit() -> None:
    """A thread starts with no CUDA context, and the driver refuses context-bound calls there
    (the pointer query torch and Triton's launcher make for every tensor): the mapper's
    default ``thread_init``, the backend's ``bind_thread``, makes the device's primary context
    current on the mapper thread before its units run."""
    backend = fake_backend()
    drv = backend.cu
    region = VirtualRegion(PagePool(backend, 8), 4 * GRAN)
    region.map_new(0, 1)
    attr = drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_POINTER

    def probe() -> tuple[int, object]:
        """This thread's context, and the driver's answer about the mapped base."""
        return int(drv.cuCtxGetCurrent()[1]), drv.cuPointerGetAttribute(attr, region.base)[0]

    primary = int(drv.cuCtxGetCurrent()[1])  # the constructor bound its own thread
    assert primary != 0 and probe() == (primary, CUresult.CUDA_SUCCESS)
    seen: list[tuple[int, object]] = []
    plain = threading.Thread(target=lambda: seen.append(probe()))
    plain.start()
    plain.join()
    unbound = BackgroundMapper(backend, thread_init=lambda: None)
    unbound.submit([lambda: seen.append(probe())])
    unbound.wait()
    unbound.close()
    mapper = BackgroundMapper(backend)  # thread_init: backend.bind_thread
    mapper.submit([lambda: seen.append(probe()), lambda: region.map_new(1, 2)])
    mapper.wait()
    mapper.close()
    no_context = (0, CUresult.CUDA_ERROR_INVALID_CONTEXT)
    assert seen == [no_context, no_context, (primary, CUresult.CUDA_SUCCESS)]
    assert region.num_mapped == 3 and drv.calls.count("cuMemMap") == 3
    region.close()


@pytest.mark.gpu
def test_real_vmm_pages_under_a_torch_tensor() -> None:
    backend = CudaMemoryBackend(None, 8)
    pool = PagePool(backend, 8)
    region = VirtualRegion(pool, 4 * backend.page_size)
    region.map_new(0, 2)
    data = region.as_bytes()[: 2 * backend.page_size].view(torch.float32)
    data.fill_(3.0)
    assert float(data.sum()) == 3.0 * data.numel()
    assert data.data_ptr() == region.base  # zero-copy
    backend.synchronize()
    region.unmap(0, 2)
    region.close()
    pool.release_all_idle()
    backend.close()
