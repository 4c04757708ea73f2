"""Automatic prefix caching in both KV modes: hash chains, sharing, salts, eviction, no leaks."""

from __future__ import annotations

import random

import pytest
import torch
from test_scheduler import MarkerRunner, next_token

from vmkv import LLM, SamplingParams
from vmkv.config import CacheConfig
from vmkv.engine.scheduler import Scheduler
from vmkv.engine.sequence import Request, Sequence
from vmkv.kv import KVSpec, PagedKVCache, VirtualKVCache, create_kv_cache
from vmkv.kv.prefix import chain_hasher
from vmkv.memory import PagePool
from vmkv.memory.host import HostMemoryBackend

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64)  # 2048 B per token (all layers)


def paged(num_blocks: int = 32) -> PagedKVCache:
    return PagedKVCache(SPEC, num_blocks=num_blocks, block_size=16, max_model_len=512,
                        enable_prefix_caching=True)


def virtual(page: int = 16 * 2048, num_pages: int = 32, layout: str = "all-layers"
            ) -> VirtualKVCache:
    pool = PagePool(HostMemoryBackend(page, num_pages), num_pages)
    return VirtualKVCache(SPEC, pool=pool, num_slots=8, max_model_len=512, layout=layout,
                          enable_prefix_caching=True)


def compute(kv, rid: str, tokens: list[int], salt: str | None = None) -> int:
    """Admit a request the way the scheduler does and 'compute' its whole prompt."""
    hit = kv.prefix.match(rid, tokens, salt)
    assert kv.allocate(rid, len(tokens) - hit)
    kv.prefix.publish(rid, tokens, len(tokens), salt)
    return hit


def units(kv, rid: str) -> list:
    if isinstance(kv, PagedKVCache):
        return kv.block_table(rid)
    store = kv.prefix.caching.units
    return [store.unit_payload(rid, i) for i in range(kv.mapped_pages(kv.slot(rid)))]


MAKERS = {"paged": paged, "virtual": virtual}


@pytest.mark.parametrize("mode", MAKERS)
def test_a_common_prefix_is_shared_not_recomputed(mode: str) -> None:
    kv = MAKERS[mode]()
    base = list(range(100, 140))  # 40 tokens: 2 full units of 16 + a partial one
    assert compute(kv, "a", base) == 0
    first_units = units(kv, "a")[:2]
    kv.free("a")  # the full units stay cached, held only by the cache
    usage = kv.accounting.usage
    assert usage.bytes_in_use == 0 and usage.bytes_cached == 2 * 16 * 2048
    hit = compute(kv, "b", base[:33] + [7] * 10)
    assert hit == 32  # two full units; token 32 is in the third, which differs
    assert units(kv, "b")[:2] == first_units  # the same physical blocks/pages ...
    refs = kv.pool.ref_cnt
    for unit in first_units:  # ... referenced by the cache and by b
        for page in (unit if isinstance(unit, tuple) else (unit,)):
            assert refs[page] == 2
    kv.accounting.check()


def test_virtual_keeps_a_cached_prefix_mapped_and_a_hit_adopts_it_in_place() -> None:
    """A finished request's slot keeps the pages the cache holds; a later hit on that prefix
    takes that very slot, with no map call; a request with another prompt taking such a slot
    leaves the cached pages to the cache (unmapped there) and maps fresh ones."""
    kv = virtual()
    base = list(range(100, 140))  # 2 full units (pages) + a partial one
    compute(kv, "a", base)
    slot, cached = kv.slot("a"), units(kv, "a")[:2]
    kv.free("a")
    assert kv.mapped_pages(slot) == 3 and kv.accounting.usage.bytes_cached == 2 * 16 * 2048
    maps = kv.accounting.memory_stats()["map"]["calls"]
    assert maps > 0
    assert kv.prefix.match("b", base[:33] + [7] * 10, None) == 32
    assert kv.slot("b") == slot and units(kv, "b")[:2] == cached
    assert kv.accounting.memory_stats()["map"]["calls"] == maps  # nothing mapped
    kv.accounting.check()
    kv.free("b")
    other = list(range(500, 540))
    for rid in ("c", "d"):  # take every idle slot; the cached prefix survives
        assert compute(kv, rid, other if rid == "c" else [9] * 40) == 0
    assert all(kv.pool.ref_cnt[p] >= 1 for unit in cached for p in unit)
    assert compute(kv, "e", base) == 32 and units(kv, "e")[:2] == cached
    kv.accounting.check()


@pytest.mark.parametrize("mode", MAKERS)
def test_one_differing_token_invalidates_the_chain_from_its_unit(mode: str) -> None:
    kv = MAKERS[mode]()
    base = list(range(200, 264))  # 4 full units
    compute(kv, "a", base)
    changed = list(base)
    changed[40] = 1  # in unit 2
    assert compute(kv, "b", changed) == 32  # units 0 and 1 still hit, 2 and 3 not
    assert compute(kv, "c", base) == 48  # (64 - 1) // 16 units: the last token is recomputed
    kv.accounting.check()


@pytest.mark.parametrize("mode", MAKERS)
def test_different_salts_never_share(mode: str) -> None:
    kv = MAKERS[mode]()
    tokens = list(range(300, 350))
    compute(kv, "a", tokens, salt="tenant-1")
    assert compute(kv, "b", tokens, salt="tenant-2") == 0
    assert compute(kv, "c", tokens) == 0
    assert compute(kv, "d", tokens, salt="tenant-1") == 48
    kv.accounting.check()


def test_pages_holding_fractional_tokens_share_only_whole_pages() -> None:
    """A page is shareable once every token overlapping it is in the common prefix; the page a
    token straddles is copied on the first write (checked by ``check`` and the CoW path)."""
    for page, per_page in ((20 * 1024, 10), (12 * 1024, 6)):  # whole tokens per page
        cache = virtual(page=page, num_pages=96)
        tokens = list(range(500, 537))
        compute(cache, "a", tokens)
        assert compute(cache, "b", tokens[:27] + [1, 2, 3]) == (27 // per_page) * per_page
        cache.accounting.check()
    # 3072 B rows on 4 KiB pages: page 1 holds the end of token 1 and the start of token 2
    frac = VirtualKVCache(KVSpec(2, 3, 64), pool=PagePool(HostMemoryBackend(4096, 64), 64),
                          num_slots=3, max_model_len=64, enable_prefix_caching=True)
    assert [frac.prefix.caching.units.unit_span(p) for p in range(3)] == [(0, 2), (1, 3), (2, 4)]
    tokens = list(range(10, 30))
    compute(frac, "a", tokens)
    copies = frac.pool.num_in_use
    # common prefix of 9 tokens: pages 0..5 (tokens 0..8) are whole, 6 pages hold 8 tokens
    assert compute(frac, "b", tokens[:9] + [5] * 5) == 8
    # b's first write (token 8) went into shared page 5: copied, not written in place
    assert frac.pool.num_in_use > copies
    k = frac.layer_kv(0)[0]
    assert torch.equal(k[frac.slot("b"), :8], k[frac.slot("a"), :8])
    frac.accounting.check()


@pytest.mark.parametrize("mode", MAKERS)
def test_reset_forgets_every_unit_and_leaves_running_requests_their_kv(mode: str) -> None:
    kv = MAKERS[mode]()
    idle, running = list(range(100, 140)), list(range(600, 650))
    compute(kv, "idle", idle)
    kv.free("idle")  # 2 units held only by the cache
    compute(kv, "run", running)  # 3 units held by the cache and by "run"
    free_before = kv.room.free_units
    run_units = units(kv, "run")
    assert kv.prefix.reset() == 5
    assert kv.accounting.usage.bytes_cached == 0 and len(kv.prefix.caching) == 0
    assert kv.room.free_units == free_before  # cache-only units were already counted as free
    assert units(kv, "run") == run_units  # "run" keeps its KV, now its own
    assert all(kv.pool.ref_cnt[p] == 1 for u in run_units[:3]
               for p in (u if isinstance(u, tuple) else (u,)))
    assert compute(kv, "again", idle) == 0 and compute(kv, "again2", running) == 0
    kv.accounting.check()
    for rid in ("run", "again", "again2"):
        kv.free(rid)
    assert kv.prefix.reset() == 5
    kv.accounting.check()
    assert kv.accounting.usage.bytes_in_use == 0 and kv.accounting.usage.bytes_cached == 0


def test_hash_chain_is_deterministic_and_salted() -> None:
    for name in ("sha256", "builtin"):
        h = chain_hasher(name)
        a = h(None, [1, 2, 3], b"")
        assert a == h(None, [1, 2, 3], b"") and a != h(None, [1, 2, 4], b"")
        assert h(a, [4], b"") != h(None, [4], b"") and a != h(None, [1, 2, 3], b"salt")
    with pytest.raises(ValueError, match="must be one of"):
        chain_hasher("md5")


@pytest.mark.parametrize("mode", ["virtual", "paged"])
def test_500_random_requests_with_shared_prefixes_evictions_and_aborts(mode: str) -> None:
    """KV content is checked before every step (MarkerRunner): a wrongly shared or corrupted
    unit fails. Tight memory forces evictions; random aborts; nothing leaks."""
    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=64)  # 512 B per token: 8 per page
    kv = create_kv_cache(CacheConfig(kv_mode=mode, kv_cache_memory=600 * 512, page_size=4096,
                                     block_size=16, enable_prefix_caching=True),
                         spec, num_slots=8, max_model_len=512)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    runner = MarkerRunner(kv)
    rng = random.Random(mode)
    prefixes = [[rng.randrange(1, 90) for _ in range(rng.randrange(8, 120))] for _ in range(6)]
    live: list[Sequence] = []
    made = steps = 0
    while made < 500 or sched.has_work():
        while made < 500 and len(live) < 12:
            prompt = rng.choice(prefixes) + [rng.randrange(1, 90)
                                             for _ in range(rng.randrange(1, 30))]
            salt = rng.choice([None, None, "x"])
            req = Request(f"r{made}", prompt, SamplingParams(), rng.randrange(1, 12),
                          cache_salt=salt)
            seq = Sequence(f"r{made}", req, 0, list(prompt), len(prompt), None)
            sched.add(seq)
            live.append(seq)
            made += 1
        out = sched.schedule()
        assert not out.out_of_capacity
        runner.run(out)
        sched.update(out)
        for seq in out.scheduled:
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(next_token(seq.token_ids))
                if seq.num_output_tokens >= seq.request.max_tokens:
                    sched.remove(seq)
                    live.remove(seq)
        if live and rng.random() < 0.05:  # abort a random request, wherever it is
            victim = rng.choice(live)
            sched.remove(victim)
            live.remove(victim)
        kv.accounting.check()
        steps += 1
        assert steps < 20_000
    usage = kv.accounting.usage
    assert usage.num_requests == 0 and usage.bytes_in_use == 0
    assert kv.prefix.caching.hits > 0 and kv.prefix.caching.queries > kv.prefix.caching.hits
    if mode == "virtual":  # idle slots still map the pages their last requests cached
        assert kv.accounting.usage.bytes_cached > 0
        for slot in sorted(kv.slots.idle):
            kv.changes.unmap_tail(slot, kv.slots.mapped[slot])
    # every cached unit is the cache's alone now: evicting frees all of them, nothing else
    cached, evictable = len(kv.prefix.caching), kv.prefix.caching.num_evictable()
    assert cached > 0 and evictable >= cached and kv.accounting.usage.bytes_cached > 0
    assert kv.prefix.caching.evict(10**9) == evictable
    assert len(kv.prefix.caching) == 0 and kv.prefix.caching.num_evictable() == 0
    assert kv.accounting.usage.bytes_cached == 0
    if mode == "paged":
        assert kv.pool.num_in_use == 0
    else:  # only idle slots' deferred pages remain; reclaiming them leaves nothing
        kv._idle.reclaim(kv.pool.num_pages, exclude=-1)
        assert kv.pool.num_in_use == 0
    kv.accounting.check()


@pytest.mark.usefixtures("default_model")
@pytest.mark.parametrize("kv_mode", ["virtual", "paged"])
def test_engine_prefills_only_the_suffix_and_matches_a_cold_run(kv_mode: str) -> None:
    # ~190 tokens: longer than a CPU engine's paged block (128 tokens)
    system = ("You are a helpful assistant. Answer briefly and precisely. " * 16).strip()
    prompts = [f"{system}\nQ: What is {a} plus {b}?\nA:" for a, b in ((2, 3), (10, 7))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    cold = LLM(kv_mode=kv_mode, max_model_len=512, enable_prefix_caching=False)
    want = [cold.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    cold.engine.close()
    llm = LLM(kv_mode=kv_mode, max_model_len=512, enable_prefix_caching=True)
    first = llm.generate(prompts[0], params, use_tqdm=False)[0]
    second = llm.generate(prompts[1], params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    prefix_len = len(llm.tokenizer(system + "\nQ: What is").input_ids)
    # all whole units of the shared prefix: 128-token blocks, or 16 KiB pages of 768-byte rows
    unit = llm.engine.kv.block_size if kv_mode == "paged" else 22
    assert second.num_cached_tokens >= prefix_len - unit
    assert second.num_cached_tokens < len(second.prompt_token_ids)
    assert [first.outputs[0].token_ids, second.outputs[0].token_ids] == want
    assert llm.engine.kv.accounting.usage.bytes_in_use == 0
    llm.engine.kv.accounting.check()
