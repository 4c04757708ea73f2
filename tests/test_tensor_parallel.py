"""Tensor parallelism on the CPU (gloo): sharding, rank 0's KV changes applied by every rank,
and whole engines whose greedy tokens must equal the 1-rank engine's, in both KV modes; a
killed worker; a worker that joins from outside (``vmkv tp-worker``, env://)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from model_helpers import save_random_model

from vmkv.config import CacheConfig, EngineConfig
from vmkv.distributed.executor import TensorParallelError, free_port
from vmkv.distributed.kv_checks import kv_digest
from vmkv.engine.llm_engine import LLMEngine
from vmkv.kv import KVSpec, create_kv_cache
from vmkv.models import load_model_config, resolve_model
from vmkv.models.loader import hf_to_vmkv
from vmkv.models.sharding import head_slices, shard_config, shard_state
from vmkv.sampling_params import SamplingParams

VOCAB = 49152  # the default model's tokenizer, which the random models borrow
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


# -- sharding ------------------------------------------------------------------------------------
def _llama(heads: int, kv_heads: int, path: Path) -> Path:
    from transformers import LlamaConfig

    save_random_model(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8,
        max_position_embeddings=512, tie_word_embeddings=False), path, seed=heads + kv_heads)
    return path


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 query heads, 4 KV heads: two ranks split both."""
    return _llama(8, 4, tmp_path_factory.mktemp("gqa"))


@pytest.fixture(scope="module")
def mqa_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 query heads, 1 KV head: two ranks each hold a copy of it."""
    return _llama(4, 1, tmp_path_factory.mktemp("mqa"))


def test_shard_config_splits_heads_and_replicates_scarce_kv_heads(mqa_model: Path) -> None:
    cfg = load_model_config(mqa_model)
    assert [head_slices(cfg, r, 2) for r in range(2)] == [((0, 2), (0, 1), (0, 64)),
                                                          ((2, 2), (0, 1), (64, 64))]
    shard = shard_config(cfg, 1, 2)
    assert (shard.num_heads, shard.num_kv_heads, shard.intermediate_size,
            shard.tensor_parallel_size) == (2, 1, 64, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide the model's 4 "
                                         "attention heads"):
        shard_config(cfg, 0, 3)
    default = load_model_config(resolve_model(None, progress=False))  # 9 heads, 3 KV heads
    with pytest.raises(ValueError, match="9 attention heads"):
        shard_config(default, 0, 2)


def test_shards_recompose_the_whole_projections(gqa_model: Path) -> None:
    """Column shards are row blocks of the whole weight; row-parallel outputs sum to the
    whole output (bias counted once)."""
    from safetensors.torch import load_file

    cfg = load_model_config(gqa_model)
    state = hf_to_vmkv(load_file(gqa_model / "model.safetensors"))
    shards = [shard_state(state, cfg, r, 2) for r in range(2)]
    x = torch.randn(3, cfg.q_size)
    o = "layers.0.self_attn.o_proj.weight"
    whole = x @ state[o].T
    halves = [x[:, r * cfg.q_size // 2 : (r + 1) * cfg.q_size // 2] @ shards[r][o].T
              for r in range(2)]
    torch.testing.assert_close(halves[0] + halves[1], whole)
    qkv = "layers.0.self_attn.qkv_proj.weight"
    q_rows = cfg.q_size // 2
    assert torch.equal(shards[1][qkv][:q_rows], state[qkv][q_rows : 2 * q_rows])
    assert shards[0][qkv].shape[0] == (cfg.q_size + 2 * cfg.kv_size) // 2


# -- KV decisions as data ----------------------------------------------------------------------
def _rows(kv, rid: str) -> torch.Tensor:  # noqa: ANN001
    """Layer 0's K rows of ``rid``'s tokens, as the kernels address them."""
    k, _ = kv.layer_kv(0)
    n = kv.room.num_tokens(rid)
    rows = kv.addressing([rid], [n]).rows(np.zeros(n, dtype=np.int64), np.arange(n))
    return k.reshape(-1, *k.shape[2:])[torch.as_tensor(rows)] if k.is_contiguous() else \
        k[torch.as_tensor(rows // k.shape[1]), torch.as_tensor(rows % k.shape[1])]


def _write(kv, rid: str, start: int, end: int, salt: float) -> None:  # noqa: ANN001
    """Mark ``rid``'s tokens ``start .. end - 1`` in layer 0's K (this rank's own bytes)."""
    k, _ = kv.layer_kv(0)
    rows = kv.addressing([rid], [start]).rows(np.zeros(end - start, dtype=np.int64),
                                              np.arange(start, end))
    values = torch.arange(start, end, dtype=k.dtype) + salt
    k[torch.as_tensor(rows // k.shape[1]), torch.as_tensor(rows % k.shape[1])] = (
        values.view(-1, 1, 1).expand(-1, *k.shape[2:]))


@pytest.mark.parametrize("kv_mode", ["virtual", "paged"])
def test_applied_changes_keep_every_manager_identical(kv_mode: str) -> None:
    """Allocations, forks (copy-on-write), swaps, prefix hits, evictions, frees and resets
    decided by one manager and applied to another leave both with the same rows, the same
    pages or blocks, and the same bytes at every step: the follower decides nothing."""
    spec = KVSpec(num_layers=2, num_kv_heads=1, head_dim=16)
    config = CacheConfig(kv_mode=kv_mode, kv_cache_memory=40 * 16 * spec.bytes_per_token,
                         page_size=4096, block_size=16, enable_prefix_caching=True)

    def manager():  # noqa: ANN202
        return create_kv_cache(config, spec, num_slots=6, max_model_len=256)

    leader, follower = manager(), manager()
    leader.changes.record()
    prompt = list(range(100, 140))
    held = {}

    def grow(rid: str, n: int, salt: float) -> None:
        start = leader.room.num_tokens(rid)
        assert leader.allocate(rid, n)
        sync()
        for kv in (leader, follower):  # each rank writes its own heads' K
            _write(kv, rid, start, start + n, salt)

    def sync() -> None:
        follower.changes.apply(leader.changes.take())
        assert kv_digest(leader) == kv_digest(follower)
        for rid in leader.room.request_ids():
            assert torch.equal(_rows(leader, rid), _rows(follower, rid)), rid

    for i, rid in enumerate("abcd"):
        hit = leader.prefix.match(rid, prompt + [i], None)
        grow(rid, 41 - hit, 1000.0 * i)
        leader.prefix.publish(rid, prompt + [i], 41, None)
    assert leader.fork("a", "a2")
    sync()
    grow("a2", 5, 7000.0)  # the shared partial page or block is copied first
    held["b"] = leader.swap.out("b")
    sync()
    leader.free("c")
    grow("d", 30, 9000.0)
    assert leader.swap.back("b", held.pop("b"))
    sync()
    held["d"] = leader.swap.out("d")
    del held["d"]  # the scheduler dropped it (an abort while swapped out)
    leader.prefix.reset()
    changes = leader.changes.take()
    assert any(type(c).__name__ == "DropSwapped" for c in changes)
    follower.changes.apply(changes)
    assert kv_digest(leader) == kv_digest(follower) and not follower.changes.saved
    for rid in leader.room.request_ids():
        leader.free(rid)
    sync()
    if kv_mode == "virtual":  # a follower whose pages went elsewhere refuses, never chooses
        pool = follower.pool
        for part in range(pool.partitions):
            assert pool.allocate(pool.num_free_in(part), None, part) is not None
        assert leader.allocate("y", 250)
        with pytest.raises(ValueError, match="which is not free"):
            follower.changes.apply(leader.changes.take())
    leader.close()
    follower.close()


# -- whole engines -------------------------------------------------------------------------------
def _config(model: Path, kv_mode: str, tp: int, *, tokens: int = 2048,
            kv_cache_dtype: str = "auto", page_tokens: int = 32, **kw: object) -> EngineConfig:
    """The same geometry at every tp: ``tokens`` of KV in ``page_tokens``-token pages
    (all-layers layout; whole OS pages at every tp) or the device's blocks. A rank holds 1/tp
    of the KV heads (or a copy of a scarce one), so its bytes per token (in ``kv_cache_dtype``,
    an int8 cache's scales included), page size and memory scale with that."""
    per_token = shard_config(load_model_config(model), 0, tp).kv_spec(
        "int8" if kv_cache_dtype == "int8" else torch.float32).bytes_per_token
    return EngineConfig(model=str(model), tokenizer=str(resolve_model(None, progress=False)),
                        kv_mode=kv_mode, tensor_parallel_size=tp, enforce_eager=True,
                        max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
                        kv_cache_memory=tokens * per_token, kv_layout="all-layers",
                        page_size=page_tokens * per_token, kv_cache_dtype=kv_cache_dtype,
                        **kw)  # type: ignore[arg-type]


def _workload(engine: LLMEngine) -> dict[str, list[list[int]]]:
    """Shared prefixes (prefix hits), n=2 (a fork), an abort, chunked prefill, and enough
    tokens to preempt in a small cache; returns every request's output token ids."""
    prefix = [(7 * i) % 500 + 20 for i in range(40)]
    prompts = {f"p{i}": prefix + [600 + i] * (3 + i) for i in range(5)}
    prompts["long"] = [(13 * i) % 700 + 30 for i in range(90)]
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, GREEDY)
    engine.add_request("n2", prefix[:20], SamplingParams(temperature=0.0, max_tokens=10,
                                                         ignore_eos=True, n=2))
    engine.add_request("aborted", prefix[:30], GREEDY)
    results: dict[str, list[list[int]]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = [o.token_ids for o in out.outputs]
        steps += 1
        if steps == 3:
            out = engine.abort_request("aborted")
            assert out is not None and out.outputs[0].finish_reason == "abort"
            results["aborted"] = [out.outputs[0].token_ids]
    return results


def _run(config: EngineConfig) -> tuple[dict[str, list[list[int]]], int]:
    engine = LLMEngine(config)
    try:
        results = _workload(engine)
        return results, engine.scheduler.stats.num_preemptions
    finally:
        engine.close()


@pytest.mark.parametrize(("model", "kv_mode", "preemption"), [
    ("gqa_model", "virtual", "recompute"), ("gqa_model", "paged", "swap"),
    ("mqa_model", "virtual", "swap"), ("mqa_model", "paged", "recompute")])
def test_two_ranks_equal_one(model: str, kv_mode: str, preemption: str,
                             request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
                             ) -> None:
    """Greedy tokens of 2 ranks equal 1 rank's, through prefix hits, forks, an abort and
    preemption; VMKV_TP_CHECK compares the ranks' KV managers after every step."""
    path = request.getfixturevalue(model)
    monkeypatch.setenv("VMKV_TP_CHECK", "1")
    one, preempted_one = _run(_config(path, kv_mode, 1, tokens=320, preemption_mode=preemption))
    two, preempted_two = _run(_config(path, kv_mode, 2, tokens=320, preemption_mode=preemption))
    assert preempted_one > 0 and preempted_two == preempted_one
    assert two == one
    assert "aborted" in one and len(one["n2"]) == 2 and len(one["long"][0]) == 12


@pytest.mark.parametrize("kv_mode", ["virtual", "paged"])
def test_two_ranks_equal_one_with_an_int8_cache(kv_mode: str, gqa_model: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """An int8 cache (values and their scales) split over 2 ranks gives 1 rank's greedy tokens
    through the same prefix hits, fork and abort; VMKV_TP_CHECK compares the ranks' KV managers
    after every step. (Whole OS pages of 80-byte tokens take 256 tokens, more than any request
    here grows to, so nothing is preempted: both ranks must agree on that too.)"""
    monkeypatch.setenv("VMKV_TP_CHECK", "1")
    int8 = {"tokens": 768, "kv_cache_dtype": "int8", "page_tokens": 256}
    one, preempted_one = _run(_config(gqa_model, kv_mode, 1, **int8))
    two, preempted_two = _run(_config(gqa_model, kv_mode, 2, **int8))
    assert preempted_two == preempted_one
    assert two == one
    assert "aborted" in one and len(one["n2"]) == 2 and len(one["long"][0]) == 12


@pytest.mark.parametrize("kv_mode", ["virtual", "paged"])
def test_default_model_on_three_ranks_equals_one(kv_mode: str, default_model: str) -> None:
    """SmolLM2-135M (9 heads, 3 KV heads) on 3 ranks: one KV head each."""
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 20843, 10358, 28, 216], [1, 7, 2, 9] * 5]
    outs = {}
    for tp in (1, 3):
        engine = LLMEngine(EngineConfig(
            model=str(default_model), kv_mode=kv_mode, tensor_parallel_size=tp, enforce_eager=True,
            max_model_len=256, kv_cache_memory=64 << 20))
        try:
            for i, p in enumerate(prompts):
                engine.add_request(str(i), p, GREEDY)
            done = {}
            while engine.has_unfinished_requests():
                done.update((o.request_id, o.outputs[0].token_ids) for o in engine.step()
                            if o.finished)
            outs[tp] = done
        finally:
            engine.close()
    assert outs[3] == outs[1]


def test_a_deleted_tensor_parallel_llm_makes_room_for_the_next(gqa_model: Path) -> None:
    """In one process: a 2-rank ``LLM``, deleted (never closed), then another, and one used in
    ``with`` (closed on leaving): each gives the same tokens and leaves no rank behind."""
    import gc
    import weakref

    from vmkv import LLM

    config = _config(gqa_model, "paged", 2)
    prompt = list(range(30, 50))
    first = LLM.from_config(config)
    want = first.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    workers = list(first.engine.executor.workers.values())
    engine = weakref.ref(first.engine)
    del first
    gc.collect()  # (an engine is freed by reference counting already; this makes it certain)
    assert engine() is None
    assert all(w.wait(10) == 0 for w in workers)  # the ranks were told to stop, and did
    second = LLM.from_config(config)
    assert second.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want
    del second
    with LLM.from_config(config) as third:
        assert third.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want
        workers = list(third.engine.executor.workers.values())
    assert all(w.poll() == 0 for w in workers)
    with pytest.raises(RuntimeError, match="this engine is closed"):
        third.generate(prompt, GREEDY, use_tqdm=False)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_a_killed_worker_fails_the_engine_fast_and_leaves_no_process(gqa_model: Path) -> None:
    engine = LLMEngine(_config(gqa_model, "virtual", 2))
    workers = list(engine.executor.workers.values())
    engine.add_request("r", list(range(30, 60)), SamplingParams(max_tokens=200, ignore_eos=True))
    engine.step()
    os.kill(workers[0].pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) exited with code -9"):
        for _ in range(50):
            engine.step()
    assert time.monotonic() - started < 5
    engine.close()
    assert not any(_alive(w.pid) for w in workers)


def test_a_hung_worker_fails_the_engine_after_the_timeout(gqa_model: Path) -> None:
    """A stopped (SIGSTOP) worker: rank 0's next all-reduce gives up after
    ``distributed_timeout``; close() kills the worker without waiting for it. (The start-up
    rendezvous is not held to those 3 s: a worker may take longer to start on a busy machine.)"""
    engine = LLMEngine(_config(gqa_model, "paged", 2, distributed_timeout=3))
    worker = next(iter(engine.executor.workers.values()))
    engine.add_request("r", list(range(30, 60)), SamplingParams(max_tokens=200, ignore_eos=True))
    engine.step()
    os.kill(worker.pid, signal.SIGSTOP)
    started = time.monotonic()
    with pytest.raises(TensorParallelError, match="a tensor-parallel rank failed"):
        for _ in range(50):
            engine.step()
    assert 2.5 < time.monotonic() - started < 15
    closing = time.monotonic()
    engine.close()
    assert time.monotonic() - closing < 5 and not _alive(worker.pid)


def _serve_one_request(engine: LLMEngine) -> None:
    """One greedy request through ``engine`` to its 12 tokens, then close it."""
    try:
        engine.add_request("r", list(range(30, 50)), GREEDY)
        while engine.has_unfinished_requests():
            outs = engine.step()
        assert len(outs[0].outputs[0].token_ids) == 12
    finally:
        engine.close()


def test_a_failed_rendezvous_leaves_the_process_able_to_start_an_engine(
        gqa_model: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A rank 0 whose other rank never came fails its rendezvous; the next engine of the
    same process still meets its fresh workers (torch names a group's store keys by a count of
    the process's groups, the failed one included, unless it is reset)."""
    from vmkv.distributed import collectives

    monkeypatch.setattr(collectives, "RENDEZVOUS_TIMEOUT", 0.5)
    with pytest.raises(RuntimeError, match="[Tt]imeout"):
        collectives.init_tensor_parallel(0, 2, f"file://{tmp_path / 'store'}", "cpu", 0.5)
    monkeypatch.undo()
    _serve_one_request(LLMEngine(_config(gqa_model, "paged", 2, distributed_timeout=5)))


def test_an_outside_worker_joins_through_env(gqa_model: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 started by hand (``vmkv tp-worker``, torchrun-style variables), as on a second
    machine; the engine starts only rank 0 (tp_local_ranks=1)."""
    port = str(free_port())
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", port)
    worker = subprocess.Popen(
        [sys.executable, "-m", "vmkv.cli", "tp-worker"],
        env={**os.environ, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    try:
        config = _config(gqa_model, "paged", 2, tp_local_ranks=1,
                         distributed_init_method="env://")
        _serve_one_request(LLMEngine(config))
        assert worker.wait(30) == 0
    finally:
        worker.kill()


def test_two_ranks_serve_the_openai_client_compiled(gqa_model: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiled 2-rank engine (the all-reduce as ``vmkv::all_reduce`` inside the graph)
    behind the HTTP server: completions and streams equal the 1-rank engine's text; a worker
    killed while idle turns /health and new requests into 503 naming the rank."""
    import httpx
    from serving import client_of, serve

    prompt = list(range(40, 64))
    reference = LLMEngine(_config(gqa_model, "virtual", 1))
    try:
        reference.add_request("ref", prompt, GREEDY)
        while reference.has_unfinished_requests():
            outs = reference.step()
        expected = outs[0].outputs[0].text
    finally:
        reference.close()
    monkeypatch.setenv("VMKV_COMPILE", "1")
    config = replace(_config(gqa_model, "virtual", 2), enforce_eager=False)
    server = serve(config)
    running = next(server)
    try:
        assert running.engine.engine.executor.layers == "compiled"
        client = client_of(running)
        kwargs = {"model": "smol", "prompt": prompt, "max_tokens": 12, "temperature": 0.0,
                  "extra_body": {"ignore_eos": True}}
        assert client.completions.create(**kwargs).choices[0].text == expected
        chunks = client.completions.create(stream=True, **kwargs)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
        worker = next(iter(running.engine.engine.executor.workers.values()))
        os.kill(worker.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while httpx.get(f"{running.url}/health").status_code == 200:
            assert time.monotonic() < deadline, "/health still 200 after a worker died"
            time.sleep(0.1)
        health = httpx.get(f"{running.url}/health")
        assert health.status_code == 503 and "rank 1" in health.json()["error"]["message"]
        with pytest.raises(openai.InternalServerError) as refused:
            client.completions.create(**kwargs)
        assert refused.value.status_code == 503
    finally:
        next(server, None)
    assert not _alive(worker.pid)
