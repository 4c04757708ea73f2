"""KV cache managers: exact block/page accounting, copy-on-write, deferred reuse, faults."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from vmkv.config import CacheConfig
from vmkv.kv import KVSpec, PagedKVCache, VirtualKVCache, create_kv_cache
from vmkv.memory import PagePool
from vmkv.memory.host import HostMemoryBackend

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64)  # 2048 B/token all layers, fp32
PAGE = 64 * 1024  # 32 tokens per page in the all-layers layout


def virtual(num_pages: int = 32, slots: int = 4, layout: str = "all-layers", page: int = PAGE,
            max_model_len: int = 1024, **kw: object) -> VirtualKVCache:
    pool = PagePool(HostMemoryBackend(page, num_pages), num_pages)
    return VirtualKVCache(SPEC, pool=pool, num_slots=slots, max_model_len=max_model_len,
                          layout=layout, **kw)


def paged(num_blocks: int = 32, block_size: int = 16) -> PagedKVCache:
    return PagedKVCache(SPEC, num_blocks=num_blocks, block_size=block_size, max_model_len=1024)


# -- paged -------------------------------------------------------------------------------------
def test_paged_block_ids_and_free_order_are_exact() -> None:
    kv = paged(num_blocks=8)
    assert kv.allocate("a", 20) and kv.block_table("a") == [0, 1]
    assert kv.allocate("b", 16) and kv.block_table("b") == [2]
    assert kv.allocate("a", 13) and kv.block_table("a") == [0, 1, 3]  # 33 tokens
    kv.free("a")  # tail first: 3, 1, 0 join the queue behind 4..7
    assert list(kv.pool.free_queue) == [4, 5, 6, 7, 3, 1, 0]
    assert kv.allocate("c", 64) and kv.block_table("c") == [4, 5, 6, 7]
    assert not kv.allocate("d", 64) and kv.room.num_tokens("d") == 0  # cannot, nothing changed
    assert list(kv.pool.free_queue) == [3, 1, 0]
    kv.accounting.check()


def test_paged_copy_on_write_copies_once_as_in_the_seed() -> None:
    kv = paged(num_blocks=8)
    assert kv.allocate("A", 20)  # blocks [0, 1]; block 1 partial (4 of 16)
    kv.kv[:, :, 0:2] = torch.randn_like(kv.kv[:, :, 0:2])
    assert kv.fork("A", "A2")
    assert kv.pool.ref_cnt[:2] == [2, 2]
    assert kv.allocate("A", 1)  # shared partial block: A gets a copy (block 2)
    assert kv.block_table("A") == [0, 2] and kv.block_table("A2") == [0, 1]
    assert torch.equal(kv.kv[:, :, 2], kv.kv[:, :, 1])
    assert kv.pool.ref_cnt[:3] == [2, 1, 1]
    assert kv.allocate("A2", 1)  # block 1 is no longer shared: written in place
    assert kv.block_table("A2") == [0, 1] and kv.pool.num_in_use == 3  # one copy in total
    kv.accounting.check()
    kv.free("A")
    kv.free("A2")
    assert kv.pool.num_in_use == 0
    kv.accounting.check()


# -- virtual ------------------------------------------------------------------------------------
def test_virtual_grows_page_by_page_and_views_alias_the_slot() -> None:
    kv = virtual()
    assert kv.allocate("a", 1) and kv.mapped_pages(kv.slot("a")) == 1
    assert kv.allocate("a", 31) and kv.mapped_pages(kv.slot("a")) == 1  # 32 tokens: one page
    assert kv.allocate("a", 1) and kv.mapped_pages(kv.slot("a")) == 2
    k, v = kv.layer_kv(1)
    s = kv.slot("a")
    k[s, :33] = 5.0
    raw = kv.regions[0].as_bytes().view(torch.float32)
    token_floats = SPEC.bytes_per_token // 4
    first = s * kv.layout.slot_bytes // 4
    # all-layers row = [layer][k|v][head][dim]; layer 1's K starts half-way through the row
    assert float(raw[first + token_floats // 2]) == 5.0
    assert k.data_ptr() != v.data_ptr() and k.stride(1) == token_floats
    kv.free("a")
    kv.accounting.check()


@pytest.mark.parametrize("layout", ["all-layers", "per-layer"])
def test_virtual_copy_on_write_keeps_both_histories(layout: str) -> None:
    kv = virtual(layout=layout, page=4096 * 4)
    assert kv.allocate("p", 37)
    for layer in range(SPEC.num_layers):
        k, v = kv.layer_kv(layer)
        k[kv.slot("p"), :37] = torch.randn(37, 2, 64)
        v[kv.slot("p"), :37] = torch.randn(37, 2, 64)
    assert kv.fork("p", "c")
    in_use = kv.pool.num_in_use
    assert kv.allocate("c", 1)  # the partial page is shared: copied first, then written
    assert kv.pool.num_in_use == in_use + kv.layout.num_regions
    assert kv.allocate("p", 1)  # now private again: no copy
    assert kv.pool.num_in_use == in_use + kv.layout.num_regions
    for layer in range(SPEC.num_layers):
        k, v = kv.layer_kv(layer)
        k[kv.slot("c"), 37] = 1.0
        k[kv.slot("p"), 37] = 2.0
        assert torch.equal(k[kv.slot("c"), :37], k[kv.slot("p"), :37])
        assert torch.equal(v[kv.slot("c"), :37], v[kv.slot("p"), :37])
        assert float(k[kv.slot("c"), 37].sum()) == 128.0
        assert float(k[kv.slot("p"), 37].sum()) == 256.0
    kv.accounting.check()


def test_per_layer_growth_is_mirrored_across_the_region_partitions() -> None:
    """With one partition per region, region 0's allocation decides a growth and region r takes
    the same pages of its own partition: one mmap per region and run. Where a mirrored page is
    taken already, the regions allocate one by one and stay in lockstep."""
    regions, part = 2 * SPEC.num_layers, 16
    pool = PagePool(HostMemoryBackend(16 * 1024, regions * part), regions * part,
                    partitions=regions)
    kv = VirtualKVCache(SPEC, pool=pool, num_slots=4, max_model_len=1024, layout="per-layer")
    maps = kv.backend.stats.ops["map"].calls
    assert kv.allocate("a", 40)  # 512 B per token and region: 2 pages each
    first = kv.regions.pages(kv.layout.slot_pages * kv.slot("a"), 2)
    assert first == [[p + r * part for p in first[0]] for r in range(regions)]
    assert kv.backend.stats.ops["map"].calls - maps == regions  # one run per region
    stolen = [2 * part + p for p in range(2, part - 2)]  # all but region 2's last 2 free pages
    pool.take(stolen)
    assert kv.allocate("b", 40)
    got = kv.regions.pages(kv.layout.slot_pages * kv.slot("b"), 2)
    assert got[2] == [3 * part - 2, 3 * part - 1]  # region 2 could not mirror region 0
    assert all(got[r] == [p + r * part for p in got[0]] for r in (0, 1, 3))
    for layer in range(SPEC.num_layers):
        for t in kv.layer_kv(layer):
            t[kv.slot("b"), :40] = float(layer)
    assert all(float(t[kv.slot("b"), :40].sum()) == layer * 40 * 128
               for layer in range(SPEC.num_layers) for t in kv.layer_kv(layer))
    for page in stolen:
        pool.release(page)
    kv.accounting.check()
    for rid in "ab":
        kv.free(rid)
    kv.accounting.check()
    assert kv.accounting.usage.bytes_in_use == 0


def _present(va: int, nbytes: int) -> list[bool]:
    """Whether each OS page of ``[va, va+nbytes)`` has a page-table entry now (bit 63 of
    ``/proc/self/pagemap``, readable without privileges)."""
    import mmap
    import struct

    first, count = va // mmap.PAGESIZE, nbytes // mmap.PAGESIZE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = struct.unpack(f"{count}Q", f.read(count * 8))
    return [bool(e >> 63) for e in entries]


def test_a_precreated_host_pool_warms_the_idle_slots_at_start_up() -> None:
    """An engine's pre-created host pool spreads half its pages over the idle slots, mapped and
    with their page-table entries present: a request that fits starts with no map call and no
    first-access fault, a longer one grows from the free half without touching the other
    slots, and the pages stay with the slots when requests finish."""
    page, regions, slots = 16 * 1024, 2 * SPEC.num_layers, 4  # per-layer: 32 tokens per page
    config = CacheConfig(kv_mode="virtual", kv_layout="per-layer", page_size=page,
                         kv_cache_memory=regions * 32 * page, precreate=True)
    kv = create_kv_cache(config, SPEC, num_slots=slots, max_model_len=1024)
    assert isinstance(kv, VirtualKVCache)
    # (128 pages / 2) / (4 regions x 4 slots)
    assert "4 per slot and region mapped at start-up" in kv.accounting.describe()
    assert kv.slots.mapped[1:] == [4] * slots and kv.pool.num_free == 64
    populate = kv.backend.stats.ops["populate"]
    assert (populate.calls, populate.pages) == (regions * slots, 64)
    for slot in range(1, slots + 1):
        for region in kv.regions:
            assert all(_present(region.va_of(kv.layout.slot_pages * slot), 4 * page))
    kv.accounting.check()

    maps = kv.backend.stats.ops["map"].calls
    assert kv.allocate("fits", 100)  # 4 pages: its slot's own
    assert kv.backend.stats.ops["map"].calls == maps
    assert kv.allocate("grows", 300)  # 10 pages: 6 more (and premap) from the free half
    assert kv.slots.mapped[kv.slot("grows")] >= 10
    idle = sorted(kv.slots.idle)
    assert [kv.slots.mapped[s] for s in idle] == [4] * len(idle)  # nothing reclaimed
    for layer in range(SPEC.num_layers):
        for t in kv.layer_kv(layer):
            t[kv.slot("grows"), :300] = float(layer + 1)
    assert all(float(t[kv.slot("grows"), :300].sum()) == (layer + 1) * 300 * 128
               for layer in range(SPEC.num_layers) for t in kv.layer_kv(layer))
    kv.accounting.check()
    for rid in ("fits", "grows"):
        kv.free(rid)
    kv.accounting.check()
    assert kv.accounting.usage.bytes_in_use == 0
    assert kv.pool.num_in_use == sum(kv.slots.mapped) * regions  # kept by the idle slots
    kv.close()


@pytest.mark.parametrize("config", [{"precreate": False}, {"precreate": True,
                                                           "max_idle_memory": 0}])
def test_no_slot_is_warmed_when_memory_is_created_on_demand_or_elastic(
        config: dict[str, object]) -> None:
    """Without a pre-created pool, or with --max-idle-memory (memory that follows live tokens),
    the slots start empty and their address space unmapped."""
    kv = create_kv_cache(CacheConfig(kv_mode="virtual", kv_cache_memory=1 << 20, **config),
                         SPEC, num_slots=4, max_model_len=1024)
    assert isinstance(kv, VirtualKVCache)
    assert "0 per slot and region mapped" in kv.accounting.describe()
    assert kv.slots.mapped[1:] == [0] * 4
    assert kv.allocate("a", 40)
    first = kv.regions[0].va_of(kv.layout.slot_pages * kv.slot("a"))
    assert not any(_present(first, kv.pool.page_size))  # mapped, not yet faulted in
    kv.close()


def test_virtual_deferred_reclamation_reuses_the_best_fitting_slot() -> None:
    kv = virtual(num_pages=32, slots=4)
    assert kv.allocate("big", 8 * 32)  # 8 pages
    assert kv.allocate("small", 2 * 32)  # 2 pages
    big, small = kv.slot("big"), kv.slot("small")
    kv.free("big")
    kv.free("small")
    assert kv.pool.num_in_use == 10  # both slots keep their pages
    maps = kv.backend.stats.ops["map"].calls
    assert kv.allocate("x", 50) and kv.slot("x") == small  # 2 pages cover it: best fit
    assert kv.allocate("y", 200) and kv.slot("y") == big
    assert kv.backend.stats.ops["map"].calls == maps  # no map call at all
    kv.accounting.check()


def test_virtual_reclaims_idle_and_surplus_pages_when_short() -> None:
    kv = virtual(num_pages=10, slots=4)
    assert kv.allocate("a", 8 * 32)
    kv.free("a")  # 8 pages stay mapped in an idle slot
    assert kv.allocate("b", 64)  # takes a's slot (best fit): 6 surplus pages mapped
    assert kv.allocate("c", 8 * 32)  # needs 8: 2 free + 6 reclaimed from b's surplus tail
    assert kv.mapped_pages(kv.slot("b")) == 2 and kv.pool.num_free == 0
    assert not kv.allocate("d", 1)
    kv.accounting.check()


def test_virtual_runs_out_of_slots_and_length() -> None:
    kv = virtual(slots=2, max_model_len=100)
    assert kv.allocate("a", 1) and kv.allocate("b", 1)
    assert not kv.room.can_allocate("c", 1) and not kv.allocate("c", 1)
    assert not kv.fork("a", "c")
    with pytest.raises(ValueError, match="over max_model_len \\(100\\)"):
        kv.allocate("a", 100)
    kv.accounting.check()


def test_elastic_pool_returns_memory_beyond_the_low_water_mark() -> None:
    backend = HostMemoryBackend(PAGE, 32)
    pool = PagePool(backend, 32, max_idle_pages=2)
    kv = VirtualKVCache(SPEC, pool=pool, num_slots=4, max_model_len=1024, max_idle_pages=4)
    for rid in "abc":
        assert kv.allocate(rid, 8 * 32)
        kv.layer_kv(0)[0][kv.slot(rid), : 8 * 32] = 1.0  # touch: memory really committed
    assert backend.file_bytes() == 24 * PAGE
    for rid in "abc":
        kv.free(rid)
    # at most 4 pages stay mapped in idle slots, at most 2 idle in the pool
    assert kv.accounting.usage.bytes_held <= 4 * PAGE and pool.num_idle <= 2
    assert backend.file_bytes() == pool.num_created * PAGE <= 6 * PAGE
    kv.accounting.check()


def test_usage_is_exact() -> None:
    kv = virtual(num_pages=32)
    assert kv.allocate("a", 40) and kv.allocate("b", 10)
    u = kv.accounting.usage
    assert (u.num_requests, u.num_tokens) == (2, 50)
    assert u.bytes_in_use == 3 * PAGE and u.token_bytes == 50 * SPEC.bytes_per_token
    assert u.capacity_bytes == 32 * PAGE and kv.accounting.capacity_tokens == 32 * 32
    p = paged(num_blocks=64)
    assert p.allocate("a", 40) and p.allocate("b", 10)
    assert p.accounting.usage.bytes_in_use == 4 * 16 * SPEC.bytes_per_token
    assert p.accounting.usage.token_bytes == 50 * SPEC.bytes_per_token


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (dict(kv_mode="virtuel"), "kv_mode must be one of"),
        (dict(kv_layout="rows"), "layout must be one of"),
        (dict(page_size=5000), "page_size must be a positive multiple of the OS page.*5000"),
        (dict(kv_cache_memory=PAGE - 1, page_size=PAGE), "holds fewer than one page"),
        (dict(kv_mode="paged", kv_cache_memory=100), "holds no block"),
        (dict(block_size=0), "block_size must be positive, got 0"),
    ],
)
def test_impossible_configurations_name_the_value(config: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        create_kv_cache(CacheConfig(**config), SPEC, num_slots=2, max_model_len=64)


_CHILD = textwrap.dedent(
    """
    import sys, torch
    from vmkv.attention.sdpa import attend_one
    from vmkv.kv import KVSpec, VirtualKVCache
    from vmkv.memory import PagePool
    from vmkv.memory.host import HostMemoryBackend
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64)  # 32 tokens per 64 KiB page
    kv = VirtualKVCache(spec, pool=PagePool(HostMemoryBackend(65536, 8), 8), num_slots=2,
                        max_model_len=256)
    kv.allocate("r", 32)  # exactly one page mapped
    k, v = kv.layer_kv(1)
    s, n = kv.slot("r"), 32 + int(sys.argv[1])
    k[s, :32] = 1.0
    v[s, :32] = 2.0
    out = attend_one(torch.ones(1, 6, 64), k[s, :n], v[s, :n], n - 1, 0.125)
    print(float(out.mean()), flush=True)
    """
)


@pytest.mark.parametrize(("extra", "returncode"), [(0, 0), (1, -11)])
def test_attention_over_a_slot_reads_only_mapped_tokens(extra: int, returncode: int) -> None:
    """SDPA over exactly the mapped tokens works; one token more touches an unmapped page."""
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(extra)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == returncode, proc.stderr
    if returncode == 0:
        assert float(proc.stdout) == 2.0
