"""The engine on the default model: batch invariance, preemption, n>1 sharing, aborts, errors."""

from __future__ import annotations

import random

import pytest
from skip_policy import require_mkl

from vmkv import LLM, SamplingParams
from vmkv.engine.llm_engine import LLMEngine
from vmkv.kernels import cpu_kernels

pytestmark = pytest.mark.usefixtures("default_model")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "import numpy as np\n",
    "My favourite fruit is",
    "In 1969, the first person to walk on the moon was",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def make_llm(kv_mode: str, **kw: object) -> LLM:
    kw.setdefault("max_model_len", 512)
    return LLM(kv_mode=kv_mode, **kw)


def run_engine(engine: LLMEngine, schedule: dict[int, list[tuple[str, str, SamplingParams]]],
               abort_at: dict[int, list[str]] | None = None) -> dict[str, list[int]]:
    """Step ``engine``, adding requests and aborting ids at the given steps; return tokens."""
    results: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished_requests() or any(k >= step for k in schedule):
        for rid, prompt, params in schedule.get(step, []):
            engine.add_request(rid, prompt, params)
        for rid in (abort_at or {}).get(step, []):
            engine.abort_request(rid)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        step += 1
        assert step < 5000
    return results


def assert_nothing_held(engine: LLMEngine) -> None:
    kv = engine.kv
    kv.accounting.check()
    usage = kv.accounting.usage
    assert usage.num_requests == 0 and usage.bytes_in_use == 0 and usage.num_tokens == 0
    assert not engine.scheduler.has_work() and not engine.requests


@pytest.fixture(scope="module")
def alone() -> dict[str, list[int]]:
    """Each prompt run on its own (the reference for batch invariance)."""
    with make_llm("virtual") as llm:
        return {p: llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
                for p in PROMPTS}


@pytest.mark.parametrize("kv_mode", ["virtual", "paged"])
def test_greedy_outputs_do_not_depend_on_the_batch(kv_mode: str, alone: dict) -> None:
    engine = make_llm(kv_mode, max_num_batched_tokens=32).engine  # chunked prefills too
    schedule: dict[int, list] = {}
    for i, prompt in enumerate(PROMPTS):  # requests join at different steps ...
        schedule.setdefault(3 * i, []).append((f"p{i}", prompt, GREEDY))
    for i in range(6):  # ... and short extra requests come and go among them
        params = SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True)
        schedule.setdefault(2 * i + 1, []).append((f"x{i}", PROMPTS[-1 - i] * 2, params))
    results = run_engine(engine, schedule)
    for i, prompt in enumerate(PROMPTS):
        assert results[f"p{i}"] == alone[prompt], f"{kv_mode}: prompt {i} changed in a batch"
    assert_nothing_held(engine)


def _many_prompts(n: int) -> list[str]:
    return [f"{PROMPTS[i % len(PROMPTS)]} (variant {i})" for i in range(n)]


@pytest.mark.slow
@pytest.mark.parametrize("kv_mode", ["virtual", "paged"])
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preemption_under_tight_memory_keeps_tokens(kv_mode: str, preemption: str) -> None:
    prompts = _many_prompts(32)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ample = make_llm(kv_mode, max_num_seqs=32)
    want = [o.outputs[0].token_ids for o in ample.generate(prompts, params, use_tqdm=False)]
    ample.engine.close()
    # ~4 requests' worth of KV (prompts ~12 tokens + 16 outputs, 46 KB per token in fp32)
    tight = make_llm(kv_mode, max_num_seqs=32, kv_cache_memory=4 * 28 * 46080 + 65536,
                     block_size=16, preemption_mode=preemption)  # paged: 7 blocks
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    stats = tight.engine.scheduler.stats
    assert stats.num_preemptions > 0
    assert got == want
    assert_nothing_held(tight.engine)


@pytest.mark.parametrize("kv_mode", ["virtual", "paged"])
def test_n_samples_share_the_prompt_kv(kv_mode: str) -> None:
    # caching off: the separate requests must not share the prompt through the prefix cache;
    # paged: 16-token blocks, so the ~70-token prompt fills whole blocks the samples share
    llm = make_llm(kv_mode, enable_prefix_caching=False, block_size=16)
    engine = llm.engine
    prompt = " ".join(PROMPTS)  # ~70 tokens
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)

    def peak_bytes(schedule: dict) -> tuple[int, dict]:
        peak, outs, step = 0, {}, 0
        for rid, p, sp in schedule[0]:
            engine.add_request(rid, p, sp)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = [c.token_ids for c in out.outputs]
            peak = max(peak, engine.kv.accounting.usage.bytes_in_use)
            step += 1
        return peak, outs

    shared_peak, shared = peak_bytes({0: [("n4", prompt, params)]})
    separate = [(f"s{i}", prompt, SamplingParams(temperature=1.0, seed=7 + i, max_tokens=8,
                                                      ignore_eos=True)) for i in range(4)]
    separate_peak, singles = peak_bytes({0: separate})
    # each sample equals the request run alone with the sample's seed (seed + index)
    assert shared["n4"] == [singles[f"s{i}"][0] for i in range(4)]
    assert len({tuple(t) for t in shared["n4"]}) > 1  # they really are different samples
    assert shared_peak < 0.6 * separate_peak, (shared_peak, separate_peak)
    assert_nothing_held(engine)


@pytest.mark.parametrize("kv_mode", ["virtual", "paged"])
def test_aborts_at_random_points_free_everything(kv_mode: str) -> None:
    engine = make_llm(kv_mode, max_num_batched_tokens=24, max_num_seqs=8).engine
    rng = random.Random(kv_mode)
    schedule: dict[int, list] = {}
    aborts: dict[int, list] = {}
    for i in range(16):
        start = rng.randrange(0, 20)
        params = SamplingParams(n=rng.choice([1, 1, 2]), temperature=0.7, seed=i,
                                max_tokens=rng.randrange(4, 20))
        schedule.setdefault(start, []).append((f"a{i}", PROMPTS[i % 8], params))
        if rng.random() < 0.6:
            aborts.setdefault(start + rng.randrange(0, 12), []).append(f"a{i}")
    run_engine(engine, schedule, aborts)
    assert engine.counters.finished["abort"] > 0
    assert_nothing_held(engine)


def test_bad_requests_raise_value_errors_and_queue_nothing() -> None:
    engine = make_llm("virtual", max_model_len=64, max_num_seqs=4).engine
    with pytest.raises(ValueError, match="maximum context length is 64"):
        engine.add_request("a", "hello", SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="n \\(5\\) exceeds max_num_seqs \\(4\\)"):
        engine.add_request("b", "hello", SamplingParams(n=5))
    with pytest.raises(ValueError, match="prompt token ids must be ints"):
        engine.add_request("c", [1, -3, 10**9])
    with pytest.raises(ValueError, match="the prompt is empty"):
        engine.add_request("d", [])
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request("e", "hi", SamplingParams(temperature=-1))
    engine.add_request("f", "hi", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("f", "hi")
    assert list(engine.requests) == ["f"]


def test_stop_strings_and_stop_tokens() -> None:
    llm = make_llm("paged")
    base = llm.generate("The capital of France is", GREEDY, use_tqdm=False)[0].outputs[0]
    assert "Paris" in base.text
    cut = base.text.index("Paris")
    stop = llm.generate("The capital of France is",
                        SamplingParams(temperature=0, max_tokens=24, stop=["ari"]),
                        use_tqdm=False)[0].outputs[0]
    assert stop.finish_reason == "stop" and stop.stop_reason == "ari"
    assert stop.text == base.text[: cut + 1]  # "... P" (the stop string is cut out)
    kept = llm.generate("The capital of France is",
                        SamplingParams(temperature=0, max_tokens=24, stop="ari",
                                       include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == base.text[: cut + 4]
    i = next(i for i in range(3, 24) if base.token_ids[i] not in base.token_ids[:i])
    token = base.token_ids[i]
    by_id = llm.generate("The capital of France is",
                         SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[token]),
                         use_tqdm=False)[0].outputs[0]
    assert by_id.token_ids == base.token_ids[: i + 1] and by_id.stop_reason == token


def test_startup_report_states_the_kv_geometry_and_prefix_caching() -> None:
    on = make_llm("virtual", max_model_len=2048).engine.startup_report()
    assert "maximum concurrency for 2,048 tokens per request" in on[1]
    assert on[1].endswith("prefix caching on")  # the default, as in vLLM
    assert "layout per-layer, page 16 KiB = 21.33 tokens" in on[2]
    assert on[3] == cpu_kernels.report_line() and "attention, argmax, decoder layers" in on[3]
    assert not on[3].count("not built")
    off = make_llm("paged", enable_prefix_caching=False).engine.startup_report()
    assert off[1].endswith("prefix caching off") and "blocks of 128 tokens" in off[2]


def test_a_cpu_engine_creates_pages_in_chunks_and_maps_ahead() -> None:
    """A virtual-mode CPU engine creates every pool page at start-up and makes it resident
    (the default), or with --no-precreate-pages creates them as it needs them, 16 at a time
    (one fallocate each); a growth maps 128 tokens (paged's block); nothing stays held
    after."""
    llm = make_llm("virtual", kv_cache_memory=64 << 20, precreate_pages=False)
    kv = llm.engine.kv
    assert kv.pool.num_created == 0 and kv.premap_pages == kv.layout.pages_for(128) - 1 >= 2
    llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    create = kv.backend.stats.ops["create"]
    assert 0 < create.calls < create.pages <= 16 * create.calls
    assert kv.pool.num_created == create.pages
    assert_nothing_held(llm.engine)
    # the default: the whole budget in one fallocate at start-up, none later, and every page
    # made resident by one populating mapping
    precreated = make_llm("virtual", kv_cache_memory=64 << 20)
    kv = precreated.engine.kv
    assert kv.pool.num_created == kv.pool.num_pages
    assert kv.backend.stats.ops["create"].calls == 1
    touch = kv.backend.stats.ops["touch"]
    assert (touch.calls, touch.pages) == (1, kv.pool.num_pages)


@pytest.mark.slow
def test_a_fused_engine_gives_the_unfused_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """A float32 CPU engine with MKL linears runs its decoder layers as fused C++ calls by
    default, in both KV modes, with the tokens of the layers run as torch modules; other
    linear backends and VMKV_FUSED_LAYERS=0 keep the modules."""
    require_mkl()
    fused = {mode: make_llm(mode, linear_backend="mkl") for mode in ("virtual", "paged")}
    for llm in fused.values():
        assert llm.engine.executor.layers == "fused"
        assert llm.engine.executor.model_parts().fused is not None
        assert llm.engine.startup_report()[-1] == (
            "decoder layers fused (C++ calls around the attention)")
    assert make_llm("paged", linear_backend="torch").engine.executor.layers != "fused"
    monkeypatch.setenv("VMKV_FUSED_LAYERS", "0")
    modules = make_llm("virtual", linear_backend="mkl")
    assert modules.engine.executor.model_parts().fused is None
    want = [o.outputs[0].token_ids for o in modules.generate(PROMPTS, GREEDY, use_tqdm=False)]
    for llm in fused.values():
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert got == want
        assert_nothing_held(llm.engine)


@pytest.mark.slow
def test_a_compiled_engine_gives_the_eager_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU engines compile their decoder layers at start-up (warm-up steps of 2 and 1 tokens
    through the real KV cache, freed again) unless told not to; the tokens do not change."""
    monkeypatch.setenv("VMKV_FUSED_LAYERS", "0")  # else the layers run fused, not compiled
    eager = make_llm("virtual")
    assert eager.engine.executor.layers == "eager" and eager.engine.startup_report()[-1] == (
        "model runs eagerly")
    want = [o.outputs[0].token_ids for o in eager.generate(PROMPTS, GREEDY, use_tqdm=False)]
    monkeypatch.setenv("VMKV_COMPILE", "1")
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # this engine's warm-up compiles its own graphs, whatever ran before
    counters.clear()
    llm = make_llm("virtual")
    assert llm.engine.executor.layers == "compiled"
    assert llm.engine.startup_report()[-1] == "decoder layers compiled (TorchInductor)"
    assert_nothing_held(llm.engine)  # the warm-up request is gone
    # the warm-up's steps of 2 and 1 tokens trace one graph, or two where torch's compile cache
    # hands the first step a graph guarded on T >= 2 (another engine compiled it earlier in
    # this process: a tensor-parallel test's, on the same xdist worker)
    warm_up_graphs = counters["stats"]["unique_graphs"]
    assert 1 <= warm_up_graphs <= 2
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == want
    alone = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == want[0]  # one request: steps of 1 token
    assert counters["stats"]["unique_graphs"] == warm_up_graphs  # that graph serves every T
    assert make_llm("paged", enforce_eager=True).engine.executor.layers == "eager"


@pytest.mark.parametrize("kv_mode", ["virtual", "paged"])
def test_closing_releases_weights_and_kv_and_a_dropped_engine_needs_no_collector(
        kv_mode: str) -> None:
    """``close()`` frees the weights and the KV memory even while something still holds the
    engine (a server's routes); an engine dropped unclosed goes by reference counting alone:
    fused layers or a prefix cache leave no cycle that would keep ~1 GiB until the collector."""
    import gc
    import weakref

    llm = make_llm(kv_mode, enable_prefix_caching=True)
    # rank 0's model and KV manager (fused layers where MKL is: the cycle-prone path)
    held_model, held_kv = llm.engine.executor.model_parts().model, llm.engine.kv
    llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    llm.close()
    assert all(t.numel() == 0 for t in [*held_model.parameters(), *held_model.buffers()])
    assert not held_kv.prefix.enabled  # the cache's memory went with the rest
    gc.collect()
    gc.disable()
    try:
        llm = make_llm(kv_mode, enable_prefix_caching=True)
        llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
        model, kv = (weakref.ref(o) for o in (llm.engine.executor.model_parts().model,
                                              llm.engine.kv))
        del llm
        assert model() is None and kv() is None
    finally:
        gc.enable()
