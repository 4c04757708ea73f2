"""Host backend and page pool: real mmap/memfd mappings, faults proven in child processes."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vmkv.memory import MappingBudgetExceeded, PagePool, VirtualRegion
from vmkv.memory.base import MemoryBackend
from vmkv.memory.errors import VmmError
from vmkv.memory.host import OS_PAGE, HostMemoryBackend, current_vma_count

PAGE = 64 * 1024


@pytest.fixture
def pool() -> PagePool:
    backend = HostMemoryBackend(PAGE, 64)
    yield PagePool(backend, 64)
    backend.close()


def test_map_write_read_unmap(pool: PagePool) -> None:
    region = VirtualRegion(pool, 8 * PAGE)
    pages = region.map_new(2, 3)
    assert pages == [0, 1, 2]
    data = region.as_bytes()
    data[2 * PAGE : 5 * PAGE].fill_(7)
    assert int(data[2 * PAGE : 5 * PAGE].sum()) == 7 * 3 * PAGE
    assert region.unmap(2, 3) == [0, 1, 2]
    assert pool.num_in_use == 0 and pool.num_idle == 3
    region.close()
    pool.check()


def test_same_page_at_two_addresses_is_shared(pool: PagePool) -> None:
    region = VirtualRegion(pool, 8 * PAGE)
    (page,) = region.map_new(0, 1)
    region.map_shared(3, [page])
    assert pool.ref_cnt[page] == 2
    data = region.as_bytes().view(torch.int32)
    data[0] = 1234  # write through VA page 0 ...
    assert int(data[3 * PAGE // 4]) == 1234  # ... is visible at VA page 3
    region.unmap(0, 1)
    assert pool.ref_cnt[page] == 1 and int(data[3 * PAGE // 4]) == 1234  # page survives
    region.unmap(3, 1)
    assert pool.ref_cnt[page] == 0
    region.close()


def test_create_and_release_commit_and_return_memory() -> None:
    backend = HostMemoryBackend(PAGE, 16)
    pool = PagePool(backend, 16, max_idle_pages=2)
    region = VirtualRegion(pool, 16 * PAGE)
    region.map_new(0, 10)
    region.as_bytes()[: 10 * PAGE].fill_(1)
    assert backend.file_bytes() == 10 * PAGE
    region.unmap(0, 10)
    assert pool.num_idle == 10 and backend.file_bytes() == 10 * PAGE  # unmapping frees nothing
    assert pool.trim() == 8  # beyond the low-water mark of 2 idle pages
    assert backend.file_bytes() == 2 * PAGE and pool.num_created == 2
    release = backend.stats.ops["release"]
    assert (release.calls, release.pages) == (1, 8)  # one punch hole for the adjacent run
    region.close()
    backend.close()


def test_a_precreated_pool_commits_every_page_in_one_call() -> None:
    """Engines pre-create their pool: one fallocate for the range (all or none), then one
    populating mapping makes it resident (zeroed), and a page count the partitions round down
    still pre-creates every page there is."""
    backend = HostMemoryBackend(PAGE, 20)
    pool = PagePool(backend, 20, precreate=20, partitions=3)  # 18 pages: 3 x 6
    assert pool.num_pages == 18 and pool.num_created == pool.num_idle == 18
    assert backend.stats.ops["create"].calls == 1 and backend.file_bytes() == 18 * PAGE
    touch = backend.stats.ops["touch"]
    assert (touch.calls, touch.pages) == (1, 18)
    region = VirtualRegion(pool, 6 * PAGE, partition=1)
    assert region.map_new(0, 2) == [6, 7]  # idle pages: nothing more to create
    assert backend.stats.ops["create"].calls == 1
    assert not backend.as_tensor(region.base, 2 * PAGE).any()  # touched pages read zero
    region.close()
    pool.check()
    backend.close()
    failing = HostMemoryBackend(PAGE, 8)
    failing.faults.arm("create", "ENOMEM")
    with pytest.raises(VmmError, match="ENOMEM|memory"):
        PagePool(failing, 8, precreate=8)
    assert failing.file_bytes() == 0
    failing.close()


def test_pages_are_created_in_chunks_within_their_partition() -> None:
    """With ``create_chunk`` an allocation that needs an uncreated page creates the uncreated
    pages after it too (one call, not past its partition); the extras wait idle. A refused
    create changes nothing."""
    backend = HostMemoryBackend(PAGE, 16)
    pool = PagePool(backend, 16, partitions=2, create_chunk=4)  # partitions 0-7 and 8-15
    assert pool.allocate(1, partition=1) == [8]
    assert pool.num_created == 4 and pool.num_idle == 3  # pages 8-11, one fallocate
    assert pool.allocate(3, 9, partition=1) == [9, 10, 11]
    assert backend.stats.ops["create"].calls == 1
    assert pool.allocate(5, 12, partition=1) is None  # 4 free left in partition 1
    assert pool.allocate(4, 12, partition=1) == [12, 13, 14, 15]  # stops at the partition end
    assert backend.stats.ops["create"].calls == 2 and pool.num_created == 8
    pool.check()
    backend.faults.arm("create", "ENOMEM")
    with pytest.raises(VmmError):
        pool.allocate(1, partition=0)
    assert pool.num_created == 8 and backend.file_bytes() == 8 * PAGE
    pool.check()
    assert pool.allocate(1, partition=0) == [0]  # the refused page is free again
    pool.check()
    backend.close()


def test_the_default_range_create_rolls_back_a_partial_range() -> None:
    """A backend without a range call creates page by page; a refusal midway releases the
    pages that call created, then raises."""
    backend = HostMemoryBackend(PAGE, 8)
    backend.faults.arm("create", "EPERM", after=3)
    with pytest.raises(VmmError):
        MemoryBackend.create_pages(backend, 2, 5)  # the per-page loop of the base class
    assert backend.stats.ops["create"].calls == 3 and backend.stats.ops["release"].calls == 3
    assert backend.file_bytes() == 0
    backend.close()


def test_new_runs_leave_room_for_growing_neighbours(pool: PagePool) -> None:
    a = VirtualRegion(pool, 16 * PAGE, "a")
    b = VirtualRegion(pool, 16 * PAGE, "b")
    assert a.map_new(0, 2) == [0, 1]
    assert b.map_new(0, 2) == [10, 11]  # GROW_ROOM (8) free pages after a's run
    assert a.map_new(2, 2) == [2, 3]  # so a grows in place
    assert b.map_new(2, 3) == [12, 13, 14]
    assert a.num_vmas == 2 and b.num_vmas == 2  # one run + the unmapped tail each
    a.unmap(0, 4)
    assert a.num_vmas == 1 and pool.num_vmas == 3
    a.close()
    b.close()
    assert pool.num_vmas == 0


def test_room_found_again_once_pages_are_freed() -> None:
    backend = HostMemoryBackend(OS_PAGE, 32)
    pool = PagePool(backend, 32)
    try:
        pool.allocate(30)  # pages 0..29
        assert pool.allocate(1) == [30]  # no run of 1 + GROW_ROOM free: the lowest free page
        for page in range(10, 30):
            pool.release(page)
        assert pool.allocate(1) == [18]  # room again: 8 pages left after the run at 0..9
    finally:
        backend.close()


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 8), st.integers(0, 31)),
                    min_size=1, max_size=60))
def test_a_full_pool_skips_searches_that_cannot_succeed_and_answers_the_same(
        ops: list[tuple[bool, int, int]]) -> None:
    """The pool remembers which run length found no room until a page is freed; the pages it
    hands out equal those of a pool that searches every time (same ops, same answers)."""
    backends = [HostMemoryBackend(OS_PAGE, 32) for _ in range(2)]
    cached, searching = (PagePool(b, 32, partitions=2) for b in backends)
    original = PagePool._run_start

    def always_search(self: PagePool, lo: int, hi: int, num: int) -> int | None:
        self._no_room = [None] * self.partitions
        return original(self, lo, hi, num)

    searching._run_start = always_search.__get__(searching)  # type: ignore[method-assign]
    held: list[list[int]] = []
    try:
        for allocate, num, pick in ops:
            if allocate or not held:
                part, hint = pick % 2, pick if pick % 3 else None
                got = cached.allocate(num, hint, part)
                assert searching.allocate(num, hint, part) == got
                if got:
                    held.append(got)
            else:
                for page in held.pop(pick % len(held)):
                    cached.release(page)
                    searching.release(page)
        cached.check()
    finally:
        for b in backends:
            b.close()


def test_vma_count_matches_the_kernel(pool: PagePool) -> None:
    region = VirtualRegion(pool, 32 * PAGE)
    before = current_vma_count()
    region.map_new(0, 8)  # one physically contiguous run, then the PROT_NONE tail
    assert region.num_vmas == 2
    assert current_vma_count() - before == region.num_vmas - 1
    region.map_shared(10, [3])  # run, gap, single page, tail
    assert region.num_vmas == 4
    assert current_vma_count() - before == region.num_vmas - 1
    region.unmap(10, 1)
    assert region.num_vmas == 2 and current_vma_count() - before == 1
    region.close()


def test_vma_budget_fails_cleanly() -> None:
    backend = HostMemoryBackend(PAGE, 32)
    pool = PagePool(backend, 32, max_vmas=4)
    region = VirtualRegion(pool, 32 * PAGE)
    (p,) = region.map_new(0, 1)
    region.map_shared(5, [p])  # run, gap, run, tail: 4 VMAs
    with pytest.raises(MappingBudgetExceeded, match="budget of 4"):
        region.map_shared(9, [p])
    assert pool.ref_cnt[p] == 2 and region.num_vmas == 4  # nothing changed
    region.map_new(1, 4)  # extends the first run up to page 5: one VMA fewer, allowed
    assert region.num_vmas == 3
    region.close()
    pool.check()
    backend.close()


@pytest.mark.parametrize("page_size", [0, 1000, OS_PAGE + 1, -OS_PAGE])
def test_bad_page_size_names_the_value(page_size: int) -> None:
    with pytest.raises(ValueError, match=f"page_size.*{page_size}"):
        HostMemoryBackend(page_size, 4)


def test_bad_sizes_and_double_free(pool: PagePool) -> None:
    with pytest.raises(ValueError, match="multiple of the page size"):
        VirtualRegion(pool, PAGE + 1)
    region = VirtualRegion(pool, 4 * PAGE)
    region.map_new(0, 1)
    with pytest.raises(ValueError, match="already"):
        region.map_new(0, 1)
    with pytest.raises(ValueError, match="not all mapped"):
        region.unmap(0, 2)
    with pytest.raises(ValueError, match="outside"):
        region.map_new(3, 2)
    pages = region.unmap(0, 1)
    with pytest.raises(ValueError, match="double free"):
        pool.release(pages[0])
    region.close()


def test_pool_cap_answers_none_without_side_effects(pool: PagePool) -> None:
    region = VirtualRegion(pool, 128 * PAGE)
    assert region.map_new(0, 60) is not None
    assert region.map_new(60, 5) is None
    assert pool.num_in_use == 60 and region.num_mapped == 60
    region.close()


def test_stats_record_calls_and_latency(pool: PagePool) -> None:
    region = VirtualRegion(pool, 8 * PAGE)
    region.map_new(0, 4)
    region.unmap(0, 4)
    stats = pool.backend.stats.as_dict()
    assert stats["map"]["calls"] == 1 and stats["map"]["pages"] == 4
    assert stats["unmap"]["calls"] == 1 and stats["map"]["p50_us"] > 0
    region.close()


_CHILD = textwrap.dedent(
    """
    import sys, torch
    from vmkv.memory import PagePool, VirtualRegion
    from vmkv.memory.host import HostMemoryBackend
    page = 64 * 1024
    pool = PagePool(HostMemoryBackend(page, 8), 8)
    region = VirtualRegion(pool, 8 * page)
    region.map_new(0, 2)
    data = region.as_bytes().view(torch.float32)
    n = 2 * page // 4  # elements mapped
    data[:n].fill_(1.0)
    offset = int(sys.argv[1])
    print(float(data[: n + offset].sum()), flush=True)  # offset 0: inside; 1: one past
    """
)


@pytest.mark.parametrize(("offset", "returncode"), [(0, 0), (1, -11)])
def test_touching_one_element_past_the_mapping_kills_the_process(
    offset: int, returncode: int
) -> None:
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(offset)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == returncode, proc.stderr
    if returncode == 0:
        assert float(proc.stdout) == 2 * PAGE // 4
