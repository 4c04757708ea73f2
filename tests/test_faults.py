"""The memory backends' failpoints (vmkv/memory/faults.py) and what the layers above do with a
refused create, map or release: the affected request fails, every other one continues, and the
page accounting stays exact (``check()``) — on the real host backend (memfd + mmap)."""

from __future__ import annotations

import random

import pytest
from fake_cuda_driver import FakeDriver

from vmkv.kv import KVSpec, VirtualKVCache
from vmkv.memory import MappingBudgetExceeded, PagePool, VirtualRegion, VmmError
from vmkv.memory.cuda import CudaMemoryBackend
from vmkv.memory.host import HostMemoryBackend

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64)  # 4 regions in the per-layer layout
PAGE = 16 * 1024  # 32 tokens per page and region (512 B per token and region)
ROW = 32


def cache(num_pages: int = 64, slots: int = 6, prefix: bool = True,
          max_idle_pages: int | None = None) -> VirtualKVCache:
    backend = HostMemoryBackend(PAGE, num_pages)
    pool = PagePool(backend, num_pages, partitions=4, max_idle_pages=max_idle_pages)
    return VirtualKVCache(SPEC, pool=pool, num_slots=slots, max_model_len=1024,
                          layout="per-layer", enable_prefix_caching=prefix,
                          max_idle_pages=max_idle_pages)


def mark(kv: VirtualKVCache, rid: str, start: int, n: int, value: float) -> None:
    for layer in range(SPEC.num_layers):
        for t in kv.layer_kv(layer):
            t[kv.slot(rid), start : start + n] = value


def marks(kv: VirtualKVCache, rid: str, n: int) -> list[float]:
    return kv.layer_kv(0)[0][kv.slot(rid), :n, 0, 0].tolist()


@pytest.mark.parametrize(("op", "error", "after"), [
    ("map", "ENOMEM", 0), ("map", "EPERM", 2), ("create", "ENOMEM", 0), ("create", "EPERM", 3),
])
def test_a_refused_growth_fails_that_request_alone(op: str, error: str, after: int) -> None:
    kv = cache()
    assert kv.allocate("a", 40) and kv.allocate("b", 40)
    mark(kv, "a", 0, 40, 1.0)
    kv.backend.faults.arm(op, error, after=after)
    with pytest.raises(VmmError, match=f"\\({error}\\)$") as failed:
        kv.allocate("b", 64)  # needs 2 more pages in each of 4 regions: the fault lands midway
    assert ("mmap" if op == "map" else "fallocate") in str(failed.value)
    kv.accounting.check()  # every region rolled back: nothing half-mapped, no reference lost
    assert kv.room.num_tokens("b") == 40 and kv.backend.faults.fired[op] == 1
    assert kv.allocate("a", 64) and marks(kv, "a", 40) == [1.0] * 40  # others continue
    assert kv.allocate("b", 64)  # the fault was transient
    kv.accounting.check()
    for rid in "ab":
        kv.free(rid)
    kv.accounting.check()
    assert kv.accounting.usage.bytes_in_use == 0


def test_an_exhausted_vma_budget_is_a_cannot_not_an_error() -> None:
    kv = cache()
    assert kv.allocate("a", 10)
    kv.backend.faults.arm("map", "BUDGET", after=1)
    assert not kv.allocate("a", 100)  # False: the scheduler preempts, nothing changed
    kv.accounting.check()
    assert kv.room.num_tokens("a") == 10 and kv.allocate("a", 100)


@pytest.mark.parametrize("after", [0, 1, 3])
def test_copy_on_write_is_all_regions_or_none(after: int) -> None:
    kv = cache()
    assert kv.allocate("p", 40)  # the second page (tokens 32..39) is partial
    mark(kv, "p", 0, 40, 7.0)
    assert kv.fork("p", "c")
    free_before = kv.pool.num_free
    kv.backend.faults.arm("map", "ENOMEM", after=after)  # fails the copy's map in region after
    with pytest.raises(VmmError, match="ENOMEM"):
        kv.allocate("c", 1)  # writing token 40 copies the shared partial page in every region
    kv.accounting.check()  # every region still shares the page (lockstep), the copies went back
    assert kv.pool.num_free == free_before
    assert kv.allocate("c", 1)  # now it copies
    mark(kv, "c", 40, 1, 9.0)
    assert marks(kv, "p", 40) == [7.0] * 40 and marks(kv, "c", 41) == [7.0] * 40 + [9.0]
    kv.accounting.check()


def test_a_refused_share_fails_the_fork_and_the_prefix_hit() -> None:
    kv = cache()
    tokens = list(range(70))
    assert kv.allocate("a", 70)
    kv.prefix.publish("a", tokens, 70)
    kv.free("a")
    assert kv.prefix.match("a2", tokens) == 64  # a's idle slot still maps them: nothing to map
    kv.backend.faults.arm("map", "EPERM", after=2)
    with pytest.raises(VmmError, match="EPERM"):
        kv.prefix.match("b", tokens)  # maps the cached pages into another slot: refused midway
    kv.accounting.check()
    assert kv.room.num_tokens("b") == 0 and kv.prefix.match("b", tokens) == 64
    kv.backend.faults.arm("map", "ENOMEM", after=1)
    with pytest.raises(VmmError):
        kv.fork("b", "c")
    kv.accounting.check()
    assert "c" not in kv.room.request_ids() and kv.fork("b", "c")
    kv.accounting.check()


def test_a_refused_release_keeps_the_page_idle_until_a_later_trim() -> None:
    kv = cache(max_idle_pages=0, prefix=False)
    assert kv.allocate("a", 100)
    mark(kv, "a", 0, 100, 1.0)
    kv.backend.faults.arm("release", "EPERM")
    kv.free("a")
    kv.accounting.check()
    assert kv.pool.num_idle > 0  # the punch hole was refused: still created, still counted
    assert kv.allocate("b", 1)
    kv.free("b")  # the next trim returns them
    kv.accounting.check()
    assert kv.pool.num_idle == 0 and kv.backend.file_bytes() <= PAGE  # the anchor page at most


def test_random_faults_never_break_the_accounting() -> None:
    rng = random.Random(16)
    kv = cache(num_pages=48, max_idle_pages=8)
    live: dict[str, int] = {}
    failures = 0
    for step in range(400):
        if rng.random() < 0.3:
            op = rng.choice(["create", "map", "map", "release"])
            kv.backend.faults.arm(op, rng.choice(["ENOMEM", "EPERM"]),
                                  after=rng.randrange(4), times=rng.randrange(1, 3))
        action = rng.random()
        try:
            if action < 0.35 or not live:
                rid = f"r{step}"
                tokens = list(range(rng.randrange(1, 150)))
                hit = kv.prefix.match(rid, tokens[: rng.randrange(1, len(tokens) + 1)])
                if kv.allocate(rid, len(tokens) - hit):
                    live[rid] = len(tokens)
                    kv.prefix.publish(rid, tokens, len(tokens))
                elif hit:
                    kv.free(rid)
            elif action < 0.7:
                rid = rng.choice(sorted(live))
                n = rng.randrange(1, 40)
                if live[rid] + n <= 1024 and kv.allocate(rid, n):
                    live[rid] += n
            elif action < 0.8:
                parent = rng.choice(sorted(live))
                if len(live) < 6 and kv.fork(parent, f"f{step}"):
                    live[f"f{step}"] = live[parent]
            else:
                rid = rng.choice(sorted(live))
                del live[rid]
                kv.free(rid)
        except VmmError as exc:
            assert not isinstance(exc, MappingBudgetExceeded)
            failures += 1
            for rid in list(kv.room.request_ids()):  # a request that failed while new holds nothing
                if rid not in live:
                    kv.free(rid)
        kv.accounting.check()
        assert {r: kv.room.num_tokens(r) for r in live} == live
    kv.backend.faults.disarm()
    for rid in list(live):
        kv.free(rid)
    kv.prefix.reset()
    kv.accounting.check()
    kept = sum(kv.mapped_pages(s) for s in kv.slots.idle) * len(kv.regions)  # kept for reuse
    assert failures > 20 and kv.accounting.usage.bytes_in_use == 0
    assert kv.pool.num_in_use == kept <= 8
    assert kv.pool.num_created <= 8


def test_the_cuda_backend_raises_the_driver_s_error_names() -> None:
    backend = CudaMemoryBackend(None, 8, 0, driver=FakeDriver(2 << 20))
    region = VirtualRegion(PagePool(backend, 8), 4 * backend.page_size)
    backend.faults.arm("create", "ENOMEM")
    with pytest.raises(VmmError, match="^cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY$"):
        region.map_new(0, 2)
    backend.faults.arm("map", "EPERM")
    with pytest.raises(VmmError, match="^cuMemMap failed: CUDA_ERROR_NOT_PERMITTED$"):
        region.map_new(0, 2)
    assert region.num_mapped == 0 and region.pool.num_in_use == 0
    assert region.map_new(0, 2) is not None
    region.pool.check()


def test_failpoints_refuse_nonsense() -> None:
    faults = HostMemoryBackend(PAGE, 4).faults
    with pytest.raises(ValueError, match="op must be one of"):
        faults.arm("unmap")
    with pytest.raises(ValueError, match="error must be one of"):
        faults.arm("map", "EIO")
    with pytest.raises(ValueError, match="only fail a map"):
        faults.arm("create", "BUDGET")


# -- the engine on the default model: a refused page fails one request, the others go on ------
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small",
           "The three primary colors are", "Water boils at a temperature of", "My favourite"]


def _run(engine, params, faults: list[tuple[int, str, str]]) -> dict[str, object]:  # noqa: ANN001
    """Run PROMPTS to completion, arming ``(step, op, error)`` failpoints at those steps."""
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    finished: dict[str, object] = {}
    step = 0
    while engine.has_unfinished_requests():
        assert step < 1000, f"requests never finish (lost?): {sorted(engine.requests)}"
        for at, op, error in faults:
            if at == step:
                engine.kv.backend.faults.arm(op, error)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        engine.kv.accounting.check()  # exact after every step, faults or not
        step += 1
    engine.kv.backend.faults.disarm()
    return finished


@pytest.mark.usefixtures("default_model")
def test_the_engine_fails_only_the_request_whose_memory_was_refused() -> None:
    from vmkv import SamplingParams
    from vmkv.config import EngineConfig
    from vmkv.engine.llm_engine import LLMEngine

    # room for ~2 of the 6 requests at once: growth, preemption and admission all allocate
    # pages go back to the OS as requests finish (max_idle_memory=0): every growth creates
    engine = LLMEngine(EngineConfig(max_model_len=96, max_num_seqs=6, kv_cache_memory=6 << 20,
                                    max_idle_memory=0, enable_prefix_caching=False))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    clean = _run(engine, params, [])
    assert engine.scheduler.stats.num_preemptions > 0
    faulty = _run(engine, params, [(2, "map", "ENOMEM"), (12, "create", "EPERM"),
                                   (30, "create", "ENOMEM")])
    failed = {rid for rid, out in faulty.items() if out.error}
    assert failed and len(failed) <= 3 and set(faulty) == set(clean)
    assert engine.counters.finished["error"] >= len(failed)
    for rid, out in faulty.items():
        if rid in failed:
            assert "KV cache memory error" in out.error and "failed: " in out.error
            assert out.outputs[0].finish_reason == "error"
        else:  # untouched by the faults: the same tokens as without them
            assert out.outputs[0].token_ids == clean[rid].outputs[0].token_ids
    assert engine.kv.accounting.usage.bytes_in_use == 0 and not engine.requests
    engine.kv.accounting.check()
    engine.close()


@pytest.mark.usefixtures("default_model")
def test_a_refused_fork_fails_the_request_not_the_engine() -> None:
    from vmkv import SamplingParams
    from vmkv.config import EngineConfig
    from vmkv.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(max_model_len=64, max_num_seqs=8,
                                    enable_prefix_caching=False))
    engine.add_request("forked", "Hello there", SamplingParams(n=3, max_tokens=4, seed=1))
    engine.add_request("plain", "Good morning", SamplingParams(max_tokens=4, temperature=0))
    engine.kv.backend.faults.arm("map", "ENOMEM", after=2)  # the prefills map, then a fork
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
        engine.kv.accounting.check()
    assert outs["forked"].error and all(c.finish_reason == "error"
                                         for c in outs["forked"].outputs)
    assert outs["plain"].error is None and len(outs["plain"].outputs[0].token_ids) == 4
    assert engine.kv.accounting.usage.bytes_in_use == 0
    engine.close()


@pytest.mark.usefixtures("default_model")
def test_a_refused_swap_out_fails_the_victim_and_loses_no_request() -> None:
    """Swap preemption whose copy-out the memory layer refuses (possible on a GPU: pinned host
    memory, an unmap; the host backend never refuses it, so the refusal is injected into the
    real manager's call): the victim finishes with an error, nothing is lost or leaked."""
    from vmkv import SamplingParams
    from vmkv.config import EngineConfig
    from vmkv.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(max_model_len=96, max_num_seqs=6, kv_cache_memory=6 << 20,
                                    max_idle_memory=0, enable_prefix_caching=False,
                                    preemption_mode="swap"))
    real_swap_out, refused = engine.kv.swap.out, []

    def swap_out_refused_once(request_id: str):  # noqa: ANN202
        if not refused:
            refused.append(request_id)
            raise VmmError("cuMemUnmap failed: CUDA_ERROR_INVALID_VALUE (injected)")
        return real_swap_out(request_id)

    engine.kv.swap.out = swap_out_refused_once
    faulty = _run(engine, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), [])
    victim = refused[0].split(":")[0]  # a sequence id is "<request id>:<sample>"
    assert refused and set(faulty) == {f"r{i}" for i in range(len(PROMPTS))}
    assert faulty[victim].error and "KV cache memory error" in faulty[victim].error
    assert all(out.error is None for rid, out in faulty.items() if rid != victim)
    assert engine.kv.accounting.usage.bytes_in_use == 0 and not engine.requests
    engine.close()
