"""KV by layer group: sliding-window layers keep about their window resident, full ones every
token, in both KV modes, with the tokens of a model whose prompts outrun its window unchanged.

Virtual mode (per-layer layout): each sliding layer's regions give back the whole pages behind
the window as a request advances, its slot still contiguous at the same addresses (the rows
before the window are unmapped: a read there would fault). Paged mode: a sliding group's blocks
behind the window go back to the pool and its table holds the null block there. Tensor-parallel
ranks agree (every mutation a commit), swap and fork carry the groups, ``check()`` holds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from model_helpers import greedy_generate, hf_greedy, save_random_model
from test_kv_changes import shared_state, sync

from vmkv import LLM, SamplingParams
from vmkv.config import CacheConfig
from vmkv.kv import KVCacheManager, KVSpec, PagedKVCache, VirtualKVCache, create_kv_cache
from vmkv.kv.addressing import GroupedAddressing
from vmkv.kv.changes import DropPages, SetTable
from vmkv.kv.paged.blocks import NULL_BLOCK
from vmkv.kv.spec import LayerGroup
from vmkv.memory import PagePool
from vmkv.memory.host import HostMemoryBackend
from vmkv.models import load_model

WINDOW = 40
# 2 full layers, 4 sliding ones; 1 KV head of 16 floats: 64 B per token and region, so a 4 KiB
# page holds 64 tokens
SPEC = KVSpec(num_layers=6, num_kv_heads=1, head_dim=16,
              layer_groups=(LayerGroup((0, 3)), LayerGroup((1, 2, 4, 5), WINDOW)))
TOKENS_PER_PAGE = 64


def virtual(num_pages: int = 400, num_slots: int = 4) -> VirtualKVCache:
    pool = PagePool(HostMemoryBackend(4096, num_pages), num_pages)
    return VirtualKVCache(SPEC, pool=pool, num_slots=num_slots, max_model_len=2048,
                          layout="per-layer")


def resident_pages(kv: VirtualKVCache) -> int:
    return kv.pool.num_in_use


def test_virtual_sliding_regions_give_back_the_pages_behind_the_window() -> None:
    kv = virtual()
    assert kv.layout.layer_order == (0, 3, 1, 2, 4, 5) and kv.regions.keep == 4
    assert kv.allocate("a", 100)  # a prefill: every region maps its 2 pages
    assert kv.slots.dropped[kv.slot("a")] == 0
    for _ in range(900):  # decode to 1,000 tokens
        assert kv.allocate("a", 1)
    kv.accounting.check()
    slot = kv.slot("a")
    mapped, dropped = kv.slots.mapped[slot], kv.slots.dropped[slot]
    assert mapped == -(-1000 // TOKENS_PER_PAGE) == 16
    # the sliding regions keep the page of token 1000 - 40 on: pages 15.. (token 960 = page 15)
    assert dropped == (999 - WINDOW + 1) // TOKENS_PER_PAGE == 15
    assert resident_pages(kv) == 4 * mapped + 8 * (mapped - dropped)
    # the slot stays one contiguous range of rows; the window's rows are readable in place
    k, _ = kv.layer_kv(1)  # a sliding layer
    assert k[slot, 999 - WINDOW + 1 : 1000].sum().isfinite()
    kv.free("a")
    kv.accounting.check()
    assert kv.slots.mapped[slot] == 0  # a slot with a dropped head is emptied when freed
    kv.close()


def test_a_read_before_the_window_faults_in_a_child(tmp_path: Path) -> None:
    """The dropped pages are really unmapped (PROT_NONE): reading one kills the process."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import sys
        from vmkv.kv import KVSpec, VirtualKVCache
        from vmkv.kv.spec import LayerGroup
        from vmkv.memory import PagePool
        from vmkv.memory.host import HostMemoryBackend
        spec = KVSpec(num_layers=6, num_kv_heads=1, head_dim=16, layer_groups=(
            LayerGroup((0, 3)), LayerGroup((1, 2, 4, 5), 40)))
        pool = PagePool(HostMemoryBackend(4096, 400), 400)
        kv = VirtualKVCache(spec, pool=pool, num_slots=4, max_model_len=2048,
                            layout="per-layer")
        kv.allocate("a", 1000)
        kv.allocate("a", 1)  # the step after 1,000 tokens: pages before the window go back
        k, _ = kv.layer_kv(int(sys.argv[1]))
        slot = kv.slot("a")
        print(float(k[slot, 0].sum()))
    """)
    for layer, returncode in ((0, 0), (1, -11)):  # a full layer reads, a sliding one faults
        done = subprocess.run([sys.executable, "-c", code, str(layer)], capture_output=True,
                              cwd=Path(__file__).parent.parent, timeout=120)
        assert done.returncode == returncode, done.stderr.decode()[-500:]


def test_virtual_fork_and_swap_carry_the_groups() -> None:
    kv = virtual()
    assert kv.allocate("a", 700)
    assert kv.allocate("a", 1)
    k, v = kv.layer_kv(5)  # sliding
    slot = kv.slot("a")
    k[slot, 650:701] = 3.0
    assert kv.fork("a", "b")  # the child maps the parent's window pages, its head dropped too
    kv.accounting.check()
    assert kv.slots.dropped[kv.slot("b")] == kv.slots.dropped[slot] > 0
    assert torch.equal(k[kv.slot("b"), 650:701], k[slot, 650:701])
    assert kv.allocate("b", 1)  # copy-on-write of the shared last page
    kv.free("b")
    swapped = kv.swap.out("a")
    kv.accounting.check()
    assert kv.swap.back("a", swapped)
    assert (kv.layer_kv(5)[0][kv.slot("a"), 650:701] == 3.0).all()
    assert kv.allocate("a", 1)  # the fresh head pages go back again
    assert kv.slots.dropped[kv.slot("a")] > 0
    kv.accounting.check()
    kv.free("a")
    kv.close()


def test_virtual_tensor_parallel_ranks_agree() -> None:
    leader, follower = virtual(), virtual()
    leader.changes.record()
    assert leader.allocate("a", 300) and leader.allocate("b", 30)
    sync(leader, follower)
    for _ in range(200):
        assert leader.allocate("a", 1) and leader.allocate("b", 1)
        sync(leader, follower)
    assert leader.slots.dropped[leader.slot("a")] > 0
    assert shared_state(leader) == shared_state(follower)
    assert leader.slots.dropped == follower.slots.dropped
    assert leader.fork("a", "c")
    sync(leader, follower)
    swapped = leader.swap.out("b")
    sync(leader, follower)
    assert leader.swap.back("b", swapped)
    sync(leader, follower)
    assert shared_state(leader) == shared_state(follower)
    for rid in leader.room.request_ids():
        leader.free(rid)
    sync(leader, follower)
    assert shared_state(leader) == shared_state(follower)
    leader.accounting.check()
    follower.accounting.check()
    leader.close()
    follower.close()


def test_admission_counts_what_the_sliding_regions_hold() -> None:
    """A long prompt's admission counts the sliding regions at about a window and a step."""
    kv = virtual()
    need = kv.room.units_needed("new", 1000)
    pages = -(-1000 // TOKENS_PER_PAGE)
    assert need is not None and 4 * pages < need < 4 * pages + 8 * 3
    kv.close()


def test_prefix_caching_is_refused_where_pages_go_back() -> None:
    pool = PagePool(HostMemoryBackend(4096, 40), 40)
    with pytest.raises(ValueError, match="prefix caching cannot serve sliding-window"):
        VirtualKVCache(SPEC, pool=pool, num_slots=2, max_model_len=256, layout="per-layer",
                       enable_prefix_caching=True)
    config = CacheConfig(kv_mode="virtual", kv_cache_memory=40 * 16384, kv_layout="per-layer")
    kv = create_kv_cache(config, SPEC, num_slots=2, max_model_len=256)
    assert not kv.prefix.enabled  # off, said in one log line
    kv.close()


def paged(num_blocks: int = 300) -> PagedKVCache:
    return PagedKVCache(SPEC, num_blocks=num_blocks, block_size=16, max_model_len=2048)


def test_paged_sliding_groups_give_back_their_blocks() -> None:
    kv = paged()
    state = kv.changes
    # lanes = gcd(2, 4) = 2 layers: the full group (0, 3), sliding groups (1, 2) and (4, 5)
    assert state.groups == (((0, 3), 0), ((1, 2), WINDOW), ((4, 5), WINDOW))
    assert kv.layer_kv(4)[0].data_ptr() == kv.layer_kv(0)[0].data_ptr()  # lane 0, other rows
    assert kv.allocate("a", 100)
    for _ in range(900):
        assert kv.allocate("a", 1)
    kv.accounting.check()
    full, *sliding = (tables["a"] for tables in state.group_tables)
    assert len(full) == 1000 // 16 + 1 and NULL_BLOCK not in full
    first_kept = (999 - WINDOW + 1) // 16
    for table in sliding:  # the table holds nothing behind the window
        assert table[:first_kept] == [NULL_BLOCK] * first_kept
        assert NULL_BLOCK not in table[first_kept:]
    assert kv.pool.num_in_use == len(full) + 2 * (len(full) - first_kept)
    addr = kv.addressing(["a"], [999])
    assert isinstance(addr, GroupedAddressing) and addr.layer_group == (0, 1, 1, 0, 2, 2)
    kv.free("a")
    kv.accounting.check()
    assert kv.pool.num_in_use == 0
    kv.close()


def test_paged_fork_swap_and_ranks_carry_the_groups() -> None:
    leader, follower = paged(), paged()
    leader.changes.record()
    assert leader.allocate("a", 300) and leader.allocate("b", 30)
    sync(leader, follower)
    for _ in range(100):
        assert leader.allocate("a", 1) and leader.allocate("b", 1)
        sync(leader, follower)
    k, _ = leader.layer_kv(5)
    addr = leader.addressing(["a"], [399])
    assert isinstance(addr, GroupedAddressing)
    rows = addr.groups[2].sequence_rows(0, 400)[400 - WINDOW :]
    k.flatten(0, 1)[torch.from_numpy(rows)] = 5.0
    assert leader.fork("a", "c") and leader.allocate("c", 1)  # copy-on-write in every group
    sync(leader, follower)
    swapped = leader.swap.out("a")
    sync(leader, follower)
    leader.accounting.check()
    assert leader.swap.back("a", swapped)
    sync(leader, follower)
    addr = leader.addressing(["a"], [399])
    rows = addr.groups[2].sequence_rows(0, 400)[400 - WINDOW :]
    assert (leader.layer_kv(5)[0].flatten(0, 1)[torch.from_numpy(rows)] == 5.0).all()
    assert leader.allocate("a", 1)  # the fresh head blocks go back again
    sync(leader, follower)
    assert shared_state(leader) == shared_state(follower)
    assert [dict(t) for t in leader.changes.group_tables] == [
        dict(t) for t in follower.changes.group_tables]
    for rid in leader.room.request_ids():
        leader.free(rid)
    sync(leader, follower)
    leader.accounting.check()
    follower.accounting.check()
    assert leader.pool.num_in_use == 0
    leader.close()
    follower.close()


# -- the model: tokens unchanged with the pages behind the window gone ----------------------------
TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=16,
            max_position_embeddings=1024, bos_token_id=None, eos_token_id=None,
            pad_token_id=None)


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list, list]:
    path = tmp_path_factory.mktemp("gemma3-groups")
    hf_model = save_random_model(transformers.Gemma3TextConfig(**TINY), path, seed=2)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 320, (n,), generator=gen).tolist() for n in (150, 9, 90)]
    return path, prompts, hf_greedy(hf_model, prompts, max_new_tokens=60)


def tiny_kv(cfg: object, kv_mode: str) -> KVCacheManager:
    """Small pages (32 tokens of a region) or blocks (8 tokens), so that many go back."""
    config = CacheConfig(kv_mode=kv_mode, kv_cache_memory=3 << 20, kv_layout="per-layer",
                         block_size=8, page_size=4096, enable_prefix_caching=False)
    return create_kv_cache(config, cfg.kv_spec(torch.float32),  # type: ignore[attr-defined]
                           num_slots=4, max_model_len=256)


@pytest.mark.parametrize("chunk", [None, 20])
@pytest.mark.parametrize("kv_mode", ["virtual", "paged"])
def test_tiny_gemma3_tokens_with_pages_given_back(tiny_gemma: tuple[Path, list, list],
                                                  kv_mode: str, chunk: int | None) -> None:
    path, prompts, expected = tiny_gemma
    model, cfg = load_model(path, torch.float32, "cpu")
    kv = tiny_kv(cfg, kv_mode)
    kv.changes.record()  # to see the pages or blocks go back
    try:
        got = greedy_generate(model, kv, prompts, max_new_tokens=60, prefill_chunk=chunk)
        assert any(isinstance(c, DropPages) or isinstance(c, SetTable)
                   and NULL_BLOCK in c.blocks for c in kv.changes.take())
    finally:
        kv.close()
    assert got == expected


@pytest.fixture(scope="module")
def engine_reference(tiny_gemma: tuple[Path, list, list]) -> tuple[list, list]:
    """Twelve prompts longer than the window and transformers' 40 greedy tokens for each."""
    path, _, _ = tiny_gemma
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 320, (int(n),), generator=gen).tolist()
               for n in torch.randint(40, 120, (12,), generator=gen)]
    return prompts, hf_greedy(hf_model.eval(), prompts, max_new_tokens=40)


@pytest.mark.parametrize(("kv_mode", "preemption"), [("virtual", "recompute"),
                                                     ("paged", "swap")])
def test_tiny_gemma3_engine_preempts_under_tight_memory(
        tiny_gemma: tuple[Path, list, list], engine_reference: tuple[list, list],
        default_model: Path, kv_mode: str, preemption: str) -> None:
    """Twelve requests whose prompts outrun the window, in a KV budget for about four, through
    the engine: requests are preempted (recomputed or swapped) while their sliding layers give
    memory back, and every one ends with transformers' tokens."""
    path, _, _ = tiny_gemma
    prompts, want = engine_reference
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with LLM(model=str(path), tokenizer=str(default_model), kv_mode=kv_mode, dtype="float32",
             kv_cache_memory=400 << 10, page_size=4096, block_size=8, max_num_seqs=12,
             max_num_batched_tokens=64, preemption_mode=preemption,
             compile_layers=False) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.scheduler.stats.num_preemptions > 0
        llm.engine.kv.accounting.check()
    assert got == want
