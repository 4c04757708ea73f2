"""Every KV mutation is recorded by construction (vmkv/kv/changes.py): a manager's shared state
changes only through its change log's ``commit``, so a mutation added later, written with the
state's verbs, reaches the other tensor-parallel ranks without anyone remembering to log it.

A pair of managers stands for two ranks without processes: rank 0 records, rank 1 applies rank
0's changes (as vmkv/distributed/worker.py does), and after every call their shared state is
compared whole: slots, mapped pages, every region's page table and reference counts (virtual),
block tables (paged), token counts, and the rows the kernels read."""

from __future__ import annotations

import pytest

from vmkv.distributed.kv_checks import kv_digest
from vmkv.kv import KVCacheManager, KVSpec, PagedKVCache, VirtualKVCache
from vmkv.kv.changes import CopyPage, MapFresh, MapPages, SetTable, Tokens
from vmkv.memory import PagePool
from vmkv.memory.host import HostMemoryBackend

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=16)  # 128 B per token


class TruncatingVirtual(VirtualKVCache):
    """A new mutation, as its author would write it: give back a request's tokens past
    ``num_tokens`` (speculative decoding's rejected tokens) with the state's verbs."""

    def truncate(self, request_id: str, num_tokens: int) -> None:
        slot = self.slot(request_id)
        self.changes.commit(Tokens(request_id, num_tokens))
        self.changes.unmap_tail(slot, self.mapped_pages(slot) - self.layout.pages_for(num_tokens))

    def truncate_unlogged(self, request_id: str, num_tokens: int) -> None:
        """The same past the log: what "by construction" must make stand out."""
        slot, keep = self.slot(request_id), self.layout.pages_for(num_tokens)
        self.changes.tokens[request_id] = num_tokens
        first = slot * self.layout.slot_pages
        self.regions.unmap(first + keep, self.mapped_pages(slot) - keep)
        self.slots.mapped[slot] = keep


class TruncatingPaged(PagedKVCache):
    """The same new mutation in paged mode (the block pool is rank 0's decision state)."""

    def truncate(self, request_id: str, num_tokens: int) -> None:
        keep = -(-num_tokens // self.block_size)
        dropped = self.block_table(request_id)[keep:]
        self.changes.commit(SetTable(request_id, keep, ()))
        self.changes.commit(Tokens(request_id, num_tokens))
        for block in reversed(dropped):
            self.pool.release(block)

    def truncate_unlogged(self, request_id: str, num_tokens: int) -> None:
        keep = -(-num_tokens // self.block_size)
        for block in reversed(self.block_tables[request_id][keep:]):
            self.pool.release(block)
        del self.block_tables[request_id][keep:]
        self.changes.tokens[request_id] = num_tokens


def make(kv_mode: str) -> KVCacheManager:
    """A manager of the mode with the truncating subclass: 40 pages or blocks of 16 tokens."""
    if kv_mode == "virtual":
        pool = PagePool(HostMemoryBackend(4096, 40), 40)  # 32 tokens per page
        return TruncatingVirtual(SPEC, pool=pool, num_slots=6, max_model_len=256,
                                 enable_prefix_caching=True)
    return TruncatingPaged(SPEC, num_blocks=80, block_size=16, max_model_len=256,
                           enable_prefix_caching=True)


def shared_state(kv: KVCacheManager) -> object:
    """Everything rank 0 and rank 1 must agree on, whole."""
    tokens = dict(kv.changes.tokens)  # type: ignore[attr-defined]
    if isinstance(kv, VirtualKVCache):
        return (tokens, dict(kv.slots.slot_of), list(kv.slots.mapped),
                kv.regions.table.tolist(), list(kv.pool.ref_cnt), kv_digest(kv))
    assert isinstance(kv, PagedKVCache)
    return tokens, {r: list(t) for r, t in kv.block_tables.items()}, kv_digest(kv)


def ranks(kv_mode: str) -> tuple[KVCacheManager, KVCacheManager]:
    leader, follower = make(kv_mode), make(kv_mode)
    leader.changes.record()
    return leader, follower


def sync(leader: KVCacheManager, follower: KVCacheManager) -> list[object]:
    changes = leader.changes.take()
    follower.changes.apply(changes)
    return changes


@pytest.mark.parametrize("kv_mode", ["virtual", "paged"])
def test_a_new_mutation_written_with_the_verbs_reaches_the_other_rank(kv_mode: str) -> None:
    leader, follower = ranks(kv_mode)
    prompt = list(range(100, 164))
    for rid in "abc":
        hit = leader.prefix.match(rid, prompt + [ord(rid)])
        assert leader.allocate(rid, 65 - hit)
        leader.prefix.publish(rid, prompt + [ord(rid)], 65)
        sync(leader, follower)
    assert leader.fork("a", "a2") and leader.allocate("a2", 40)  # copy-on-write, growth
    sync(leader, follower)
    assert shared_state(leader) == shared_state(follower)
    held = leader.changes.tokens["a2"]  # type: ignore[attr-defined]
    leader.truncate("a2", 70)  # type: ignore[attr-defined]
    changes = sync(leader, follower)
    assert changes and leader.room.num_tokens("a2") == 70 < held
    assert shared_state(leader) == shared_state(follower)
    leader.accounting.check()
    assert leader.allocate("a2", 30)  # the same pages or blocks again, on both ranks
    sync(leader, follower)
    assert shared_state(leader) == shared_state(follower)
    for rid in leader.room.request_ids():
        leader.free(rid)
    sync(leader, follower)
    assert shared_state(leader) == shared_state(follower)
    leader.accounting.check()
    leader.close()
    follower.close()


@pytest.mark.parametrize("kv_mode", ["virtual", "paged"])
def test_a_mutation_past_the_log_leaves_the_ranks_apart(kv_mode: str) -> None:
    """The comparison above sees a mutation that bypasses ``commit``: the property it checks
    is not one every manager has anyway."""
    leader, follower = ranks(kv_mode)
    assert leader.allocate("a", 120)
    sync(leader, follower)
    assert shared_state(leader) == shared_state(follower)
    leader.truncate_unlogged("a", 10)  # type: ignore[attr-defined]
    assert sync(leader, follower) == []
    assert shared_state(leader) != shared_state(follower)
    leader.close()
    follower.close()


@pytest.mark.parametrize("kv_mode", ["virtual", "paged"])
def test_the_log_holds_what_was_applied_and_a_follower_chooses_nothing(kv_mode: str) -> None:
    leader, follower = ranks(kv_mode)
    assert leader.allocate("a", 40) and leader.fork("a", "b") and leader.allocate("b", 1)
    changes = leader.changes.take()
    assert not any(isinstance(c, MapFresh) or isinstance(c, CopyPage) and c.pages is None
                   for c in changes)  # rank 0's choices are logged as made
    if kv_mode == "virtual":
        assert any(isinstance(c, MapPages) and c.fresh for c in changes)
        assert any(isinstance(c, CopyPage) for c in changes)
        for choice in (MapFresh(0, 1), CopyPage(0)):
            with pytest.raises(ValueError, match="leaves a choice"):
                follower.changes.apply([choice])
    follower.changes.apply(changes)
    assert shared_state(leader) == shared_state(follower)
    leader.close()
    follower.close()
    silent = make(kv_mode)
    assert silent.allocate("a", 40) and silent.changes.take() == []  # not recording
    silent.close()
