"""Property tests: random allocate / grow / fork / free sequences on both KV modes at once.

With a virtual page that holds exactly one paged block's worth of tokens (16), the two modes must
agree on every answer (what fits), hold exactly the same bytes, leak nothing, and keep every
request's K/V history intact through copy-on-write.
"""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from vmkv.kv import KVSpec, PagedKVCache, VirtualKVCache
from vmkv.memory import PagePool
from vmkv.memory.host import HostMemoryBackend

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64)  # 2048 B per token (all layers)
BLOCK = 16
NUM_BLOCKS = 24
SLOTS = 10


class BothModes(RuleBasedStateMachine):
    layout = "all-layers"
    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        regions = 1 if self.layout == "all-layers" else 2 * SPEC.num_layers
        page = BLOCK * SPEC.bytes_per_token // regions
        pool = PagePool(HostMemoryBackend(page, NUM_BLOCKS * regions), NUM_BLOCKS * regions)
        self.virtual = VirtualKVCache(SPEC, pool=pool, num_slots=SLOTS, max_model_len=1024,
                                      layout=self.layout)
        self.paged = PagedKVCache(SPEC, num_blocks=NUM_BLOCKS, block_size=BLOCK,
                                  max_model_len=1024)
        self.history: dict[str, list[float]] = {}  # per request: the K marker of each token
        self.counter = 0

    # -- helpers ----------------------------------------------------------------------------
    def _write(self, rid: str, start: int, n: int) -> None:
        """Write a fresh marker into layer 0's K of tokens [start, start+n) in both modes."""
        marks = [float(self.counter + i) for i in range(n)]
        self.counter += n
        values = torch.tensor(marks).view(n, 1, 1).expand(n, SPEC.num_kv_heads, SPEC.head_dim)
        k_virt = self.virtual.layer_kv(0)[0]
        k_virt[self.virtual.slot(rid), start : start + n] = values
        k_paged = self.paged.layer_kv(0)[0].flatten(0, 1)
        rows = self._paged_rows(rid)[start : start + n]
        k_paged[rows] = values
        self.history[rid] = self.history.get(rid, [])[:start] + marks

    def _paged_rows(self, rid: str) -> torch.Tensor:
        table = torch.tensor(self.paged.block_table(rid), dtype=torch.int64)
        pos = torch.arange(self.paged.room.num_tokens(rid))
        return table[pos // BLOCK] * BLOCK + pos % BLOCK

    def _grow(self, rid: str, n: int) -> bool:
        cur = self.paged.room.num_tokens(rid)
        can = self.paged.room.can_allocate(rid, n)
        assert self.virtual.room.can_allocate(rid, n) == can
        ok_v = self.virtual.allocate(rid, n)
        ok_p = self.paged.allocate(rid, n)
        assert ok_v == ok_p == can, (rid, n, ok_v, ok_p)
        if ok_v and n:
            self._write(rid, cur, n)
        return ok_v

    # -- rules ------------------------------------------------------------------------------
    @rule(target=requests, n=st.integers(0, 70))
    def add(self, n: int) -> str:
        rid = f"r{self.counter}-{len(self.history)}"
        if len(self.virtual.room.request_ids()) >= SLOTS:
            return rid  # a slot-bound refusal the paged mode has no analogue of
        if self._grow(rid, n):
            self.history.setdefault(rid, [])
        return rid

    @rule(rid=requests, n=st.integers(1, 40))
    def grow(self, rid: str, n: int) -> None:
        if rid in self.history:
            self._grow(rid, n)

    @rule(target=requests, rid=requests)
    def fork(self, rid: str) -> str:
        child = f"{rid}/f{self.counter}"
        self.counter += 1
        if rid in self.history and len(self.virtual.room.request_ids()) < SLOTS:
            assert self.virtual.fork(rid, child) and self.paged.fork(rid, child)
            self.history[child] = list(self.history[rid])
        return child

    @rule(rid=consumes(requests))
    def free(self, rid: str) -> None:
        if rid in self.history:
            self.virtual.free(rid)
            self.paged.free(rid)
            del self.history[rid]

    # -- invariants -------------------------------------------------------------------------
    @invariant()
    def accounting_is_exact_and_equal(self) -> None:
        self.virtual.accounting.check()
        self.paged.accounting.check()
        uv, up = self.virtual.accounting.usage, self.paged.accounting.usage
        assert uv.num_requests == up.num_requests == len(self.history)
        assert uv.num_tokens == up.num_tokens == sum(len(h) for h in self.history.values())
        assert uv.bytes_in_use == up.bytes_in_use
        assert uv.token_bytes == up.token_bytes
        assert self.virtual.accounting.capacity_tokens == self.paged.accounting.capacity_tokens

    @invariant()
    def histories_survive_copy_on_write(self) -> None:
        k_virt = self.virtual.layer_kv(0)[0]
        k_paged = self.paged.layer_kv(0)[0].flatten(0, 1)
        for rid, marks in self.history.items():
            if not marks:
                continue
            want = torch.tensor(marks)
            got_v = k_virt[self.virtual.slot(rid), : len(marks), 0, 0]
            got_p = k_paged[self._paged_rows(rid), 0, 0]
            assert torch.equal(got_v, want), rid
            assert torch.equal(got_p, want), rid

    def teardown(self) -> None:
        for rid in list(self.history):
            self.virtual.free(rid)
            self.paged.free(rid)
        assert self.paged.pool.num_in_use == 0
        assert self.virtual.accounting.usage.bytes_in_use == 0
        self.virtual.close()
        assert self.virtual.pool.num_in_use == 0 and self.virtual.pool.num_vmas == 0


class BothModesPerLayer(BothModes):
    layout = "per-layer"


_SETTINGS = settings(max_examples=40, stateful_step_count=30, deadline=None)
TestBothModesAllLayers = BothModes.TestCase
TestBothModesAllLayers.settings = _SETTINGS
TestBothModesPerLayer = BothModesPerLayer.TestCase
TestBothModesPerLayer.settings = _SETTINGS


def test_a_copy_on_write_takes_the_slots_own_spare_tail() -> None:
    """Found by the machine above: every free page mapped (a slot that a 113-token request
    left keeps its 8 pages for the next one), a 1-token request in that slot forked, then grown
    by a token: the copy of its shared page must come from its own spare tail, as paged mode
    takes a free block."""
    m = BothModes()

    def rule(name: str, *args: object) -> str:
        return BothModes.__dict__[name].hypothesis_stateful_rule.function(m, *args)

    r0, _, r2 = rule("add", 9), rule("add", 17), rule("add", 37)
    rule("grow", r0, 8)
    rule("grow", r2, 36)
    rule("grow", r2, 40)
    rule("free", r2)
    r5, r6 = rule("add", 1), rule("add", 9)
    rule("grow", r6, 40)
    rule("add", 0)
    rule("add", 49)
    rule("grow", rule("add", 0), 1)
    rule("fork", r5)
    rule("add", 0)
    rule("add", 33)
    rule("add", 0)
    assert m.virtual.pool.num_free == 0 and m.paged.pool.num_in_use < NUM_BLOCKS
    rule("grow", r5, 1)
    m.accounting_is_exact_and_equal()
    m.histories_survive_copy_on_write()
    m.teardown()
