"""Data-parallel replicas (``--data-parallel-size``): the router alone, then real replica
processes of the default model behind the real HTTP server, driven by the openai client.

One DP=2 server (module fixture) answers the equality, prefix-cache, metrics and bad-input
tests; a ``vmkv serve --data-parallel-size 2`` process is killed piece by piece in the failure
test (a replica, then the server itself: no process may outlive it)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Iterator

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving import client_of, serve
from test_server import MODEL, Running
from test_shutdown import stream

from vmkv import LLM, SamplingParams
from vmkv.bench.launch import LaunchedServer
from vmkv.config import EngineConfig
from vmkv.distributed.worker import rank_device
from vmkv.engine.async_engine import EngineDeadError
from vmkv.engine.data_parallel import DataParallelEngine
from vmkv.engine.llm_engine import LLMEngine
from vmkv.engine.router import PREFIX_KEY_TOKENS, Router, prefix_key
from vmkv.engine.snapshot import Snapshot, combine
from vmkv.process_tuning import available_cores, replica_threads

SMALL = dict(max_model_len=256, max_num_seqs=16, kv_cache_memory=64 << 20, enforce_eager=True)


# -- the router alone (no processes) --------------------------------------------------------------
def test_new_keys_go_to_the_least_loaded_replica_and_ties_rotate() -> None:
    router = Router(3)
    assert router.choose("a", [5, 1, 3]) == 1
    assert router.choose("b", [0, 0, 0]) == 2  # the search starts after the last choice
    assert router.choose("c", [0, 0, 0]) == 0
    assert router.choose("d", [0, 0, 0]) == 1


def test_a_seen_key_sticks_to_its_replica_until_that_one_is_far_more_loaded() -> None:
    router = Router(2)  # sticky while load[owner] <= 2 * least + 8
    assert router.choose("k", [0, 0]) == 0
    assert router.choose("k", [8, 0]) == 0
    assert router.choose("k", [14, 3]) == 0
    assert router.choose("k", [15, 3]) == 1  # 15 > 2 * 3 + 8: moved, and 1 owns it now
    assert router.choose("k", [0, 8]) == 1
    assert router.choose("other", [0, 8]) == 0


def test_the_key_map_is_bounded_and_forgets_the_least_recently_used() -> None:
    router = Router(2, max_keys=2)
    router.choose("a", [0, 0])
    router.choose("b", [0, 0])
    router.choose("a", [0, 0])  # a is the most recent now
    router.choose("c", [0, 0])
    assert list(router.owners) == ["a", "c"]


def test_prefix_keys_use_the_salt_and_the_first_block_of_tokens() -> None:
    ids = list(range(40))
    assert prefix_key(ids, None) == prefix_key(ids[:PREFIX_KEY_TOKENS] + [7], None)
    assert prefix_key(ids, None) != prefix_key(ids, "tenant")
    assert prefix_key([1, 2], None) != prefix_key([1, 2, 3], None)  # short: the whole prompt
    assert prefix_key("some text", None) == (None, "some text")


def test_router_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_replicas"):
        Router(0)
    with pytest.raises(ValueError, match="expected 2 loads"):
        Router(2).choose("k", [0])
    with pytest.raises(ValueError, match="data_parallel_size must be positive"):
        EngineConfig(data_parallel_size=0)
    with pytest.raises(ValueError, match="one replica"):
        LLM(data_parallel_size=2)


def test_replica_placement_and_threads() -> None:
    """Replica i (and its tensor-parallel ranks) start at GPU i * tensor_parallel_size."""
    assert [rank_device("cpu", i) for i in range(2)] == ["cpu", "cpu"]
    assert [rank_device("cuda", i) for i in range(2)] == ["cuda:0", "cuda:1"]
    assert rank_device("cuda:2", 1) == "cuda:3"
    assert rank_device("cuda", 1 * 2) == "cuda:2"  # replica 1 of tensor_parallel_size 2
    assert replica_threads(1) == available_cores()
    assert replica_threads(available_cores() * 4) == 1


def test_combined_snapshot_sums_counts_and_recomputes_shares() -> None:
    a = Snapshot(running=2, prompt_tokens=10, finished={"stop": 1},
                 usage={"capacity_bytes": 100, "bytes_in_use": 50, "fraction": 0.5},
                 memory_ops={"map": {"calls": 3, "p99_us": 9.0}}, taken_at=5.0)
    b = Snapshot(running=1, prompt_tokens=4, finished={"stop": 2, "abort": 1},
                 usage={"capacity_bytes": 100, "bytes_in_use": 0, "fraction": 0.0},
                 memory_ops={"map": {"calls": 1, "p99_us": 20.0}}, taken_at=4.0)
    total = combine([a, b])
    assert (total.running, total.prompt_tokens, total.finished) == (3, 14, {"stop": 3,
                                                                            "abort": 1})
    assert total.usage["fraction"] == 0.25 and total.usage["bytes_in_use"] == 50
    assert total.memory_ops["map"] == {"calls": 4, "p99_us": 20.0}  # the worst p99
    assert total.taken_at == 4.0  # the oldest reading


# -- a DP=2 server on real replica processes ------------------------------------------------------


@pytest.fixture(scope="module")
def dp_srv(default_model: object) -> Iterator[Running]:
    yield from serve(EngineConfig(data_parallel_size=2, **SMALL), dev_mode=True)


@pytest.fixture(scope="module")
def dp_client(dp_srv: Running) -> openai.OpenAI:
    return client_of(dp_srv, timeout=300)


@pytest.fixture(scope="module")
def one_engine(default_model: object) -> Iterator[LLM]:
    """The DP=1 reference: one in-process engine with the replicas' settings."""
    llm = LLM(**SMALL)
    yield llm
    llm.engine.close()


def replica_samples(url: str, name: str) -> dict[str, float]:
    """``{engine label: value}`` of the metric ``name`` (``"0"``, ``"1"``: vLLM's label)."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                found[sample.labels["engine"]] = sample.value
    return found


def test_dp2_answers_the_openai_client_as_one_engine_does(
        dp_client: openai.OpenAI, one_engine: LLM) -> None:
    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time"]
    want = [o.outputs[0].text for o in one_engine.generate(
        prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)]
    many = dp_client.completions.create(model=MODEL, prompt=prompts, max_tokens=12,
                                        temperature=0)
    assert [c.text for c in sorted(many.choices, key=lambda c: c.index)] == want
    for prompt, text in zip(prompts, want, strict=True):
        chunks = list(dp_client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                                   temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    (chat,) = one_engine.chat(messages, SamplingParams(temperature=0, max_tokens=12),
                              use_tqdm=False)
    stream = list(dp_client.chat.completions.create(model=MODEL, messages=messages,
                                                    max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in stream) == chat.outputs[0].text
    two = dp_client.completions.create(model=MODEL, prompt="My pet is", n=2, seed=3,
                                       max_tokens=6, temperature=1.0)  # one replica runs both
    assert sorted(c.index for c in two.choices) == [0, 1]


def test_shared_prefixes_hit_the_cache_as_often_as_on_one_replica(
        dp_srv: Running, dp_client: openai.OpenAI, one_engine: LLM) -> None:
    rng = random.Random(0)
    prefixes = [[rng.randrange(100, 20000) for _ in range(64)] for _ in range(4)]
    prompts = [prefixes[i % 4] + [rng.randrange(100, 20000) for _ in range(8)]
               for i in range(24)]  # 4 prefixes x 6 requests, interleaved
    params = SamplingParams(temperature=0, max_tokens=2)
    one_engine.reset_prefix_cache()
    one = sum(one_engine.generate(p, params, use_tqdm=False)[0].num_cached_tokens
              for p in prompts)
    assert httpx.post(f"{dp_srv.url}/reset_prefix_cache").status_code == 200
    before = replica_samples(dp_srv.url, "vllm:prompt_tokens_total")
    dp = sum(dp_client.completions.create(model=MODEL, prompt=p, max_tokens=2, temperature=0)
             .usage.prompt_tokens_details.cached_tokens for p in prompts)
    assert one > 0 and abs(dp - one) <= 0.1 * one, (dp, one)
    after = replica_samples(dp_srv.url, "vllm:prompt_tokens_total")
    spread = {r: after[r] - before[r] for r in ("0", "1")}
    assert spread["0"] > 0 and spread["1"] > 0, spread  # both replicas served the workload
    assert set(after) == {"0", "1"}  # one row per engine, no total row: sums are the reader's
    hits = replica_samples(dp_srv.url, "vllm:prefix_cache_hits_total")
    assert hits["0"] + hits["1"] > 0


def test_metrics_are_labelled_per_engine_and_sum_over_engines(
        dp_srv: Running, dp_client: openai.OpenAI) -> None:
    running = replica_samples(dp_srv.url, "vllm:num_requests_running")
    assert set(running) == {"0", "1"}
    capacity = replica_samples(dp_srv.url, "vmkv:kv_capacity_bytes")
    assert capacity["0"] == capacity["1"] > 0
    names = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total",
             "vllm:e2e_request_latency_seconds_count")
    before = {n: sum(replica_samples(dp_srv.url, n).values()) for n in names}
    r = dp_client.completions.create(model=MODEL, prompt=["One two three", "Four five"],
                                     max_tokens=3, temperature=0)
    after = {n: sum(replica_samples(dp_srv.url, n).values()) for n in names}
    assert after[names[0]] - before[names[0]] == r.usage.prompt_tokens
    assert after[names[1]] - before[names[1]] == r.usage.completion_tokens == 6
    assert after[names[2]] - before[names[2]] == 2  # each prompt's request, on its engine
    assert httpx.get(f"{dp_srv.url}/health").status_code == 200


def grammar_compiles(engine: LLMEngine) -> int:
    """How many grammars a replica compiled (a module-level function: it travels pickled)."""
    return engine.grammars.stats.misses


def test_each_grammar_is_compiled_once_by_the_replica_that_runs_it(
        dp_srv: Running, dp_client: openai.OpenAI) -> None:
    """The server of replicas compiles no grammar itself: the replica running the request
    compiles it (on a helper thread while it steps), once, and refuses what xgrammar cannot
    compile with a 400 all the same."""
    loop = dp_srv.server.servers[0].get_loop()

    def compiles() -> int:
        replicas = asyncio.run_coroutine_threadsafe(
            dp_srv.engine.call_all(grammar_compiles), loop).result(60)
        return sum(replicas)

    before = compiles()
    body = {"model": MODEL, "prompt": "Pick a colour:", "max_tokens": 8, "temperature": 0,
            "structured_outputs": {"choice": ["red", "green", "blue"]}}
    for _ in range(3):  # the same prompt: the router keeps it on one replica
        r = httpx.post(f"{dp_srv.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("red", "green",
                                                                          "blue")
    assert compiles() == before + 1
    bad = httpx.post(f"{dp_srv.url}/v1/completions", timeout=120, json={
        **body, "structured_outputs": {"regex": "(unclosed"}})
    assert bad.status_code == 400 and "structured_outputs.regex" in bad.json()["error"][
        "message"]


def test_bad_input_is_refused_clearly_over_the_pipe(dp_srv: Running) -> None:
    dp_engine = dp_srv.engine
    r = httpx.post(f"{dp_srv.url}/v1/completions",
                   json={"model": MODEL, "prompt": [10**7], "max_tokens": 2})
    assert r.status_code == 400  # a token id outside the vocabulary

    async def bad_calls() -> None:
        with pytest.raises(ValueError, match="empty"):
            await dp_engine.add("dp-empty", [], SamplingParams())
        stream = await dp_engine.add("dp-dup", [1, 2, 3], SamplingParams(max_tokens=50))
        with pytest.raises(ValueError, match="already in use"):
            await dp_engine.add("dp-dup", [1, 2, 3], SamplingParams())
        stream.abort()
        with pytest.raises(ValueError, match="cannot send"):
            await dp_engine.call_all(lambda e: e.max_model_len)  # a lambda does not pickle

    asyncio.run(asyncio.wait_for(bad_calls(), 60))
    assert dp_engine.is_alive


def test_shutdown_leaves_no_replica_process(dp_srv: Running) -> None:
    dp_engine = dp_srv.engine
    assert isinstance(dp_engine, DataParallelEngine)
    pids = [r.process.pid for r in dp_engine.replicas]
    dp_srv.stop()
    dp_engine.shutdown()  # the fixture's close() again later is a no-op
    assert not dp_engine.is_alive
    assert all(not _running(pid) for pid in pids)
    with pytest.raises(EngineDeadError):
        asyncio.run(dp_engine.add("late", [1, 2], SamplingParams()))


# -- failure: a replica dies, then the server is killed -------------------------------------------
def _running(pid: int) -> bool:
    """True while ``pid`` is a live process (a zombie left for init to reap counts as gone)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while (alive := [p for p in pids if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def _replica_children() -> set[int]:
    """This process's children but the multiprocessing resource tracker (shared, long-lived)."""
    return {p.pid for p in psutil.Process().children()
            if "resource_tracker" not in " ".join(p.cmdline())}


@pytest.mark.usefixtures("default_model")
def test_a_replica_that_cannot_start_fails_the_constructor_and_leaves_no_process() -> None:
    before = _replica_children()
    with pytest.raises(ValueError, match="exceeds the model's limit"):  # found before forking
        DataParallelEngine(EngineConfig(data_parallel_size=2, max_model_len=10**7))
    assert _replica_children() == before
    with pytest.raises(ValueError, match="kv_cache_memory"):  # the replicas' own error
        DataParallelEngine(EngineConfig(data_parallel_size=2, kv_cache_memory=1,
                                        enforce_eager=True))
    assert _replica_children() == before  # both replicas ended and were reaped


@pytest.mark.usefixtures("default_model")
def test_a_dead_replica_fails_the_server_fast_and_no_process_outlives_it() -> None:
    args = ["--data-parallel-size", "2", "--max-model-len", "256", "--kv-cache-memory", "64M",
            "--enforce-eager"]
    with LaunchedServer(args) as srv:
        url = srv.base_url
        server = psutil.Process(srv.proc.pid)
        family = [p.pid for p in server.children(recursive=True)]
        replicas = [p.pid for p in server.children()
                    if "resource_tracker" not in " ".join(p.cmdline())]
        assert len(replicas) == 2, server.children()

        async def main() -> tuple[list, float, httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as client:
                flags = [asyncio.Event() for _ in range(4)]
                tasks = [asyncio.create_task(stream(url, client, 200, f)) for f in flags]
                await asyncio.wait_for(asyncio.gather(*(f.wait() for f in flags)), 120)
                os.kill(replicas[1], signal.SIGKILL)
                killed = time.monotonic()
                results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
                health = await client.get(f"{url}/health")
                while health.status_code == 200 and time.monotonic() - killed < 10:
                    await asyncio.sleep(0.05)
                    health = await client.get(f"{url}/health")
                refused = await client.post(f"{url}/v1/completions",
                                            json={"prompt": "x", "max_tokens": 2})
                return results, time.monotonic() - killed, health, refused

        results, elapsed, health, refused = asyncio.run(main())
        assert elapsed < 10
        for events in results:  # in flight on either replica: an error event, then [DONE]
            assert events[-1] == "[DONE]"
            assert "error" in events[-2] and events[-2]["error"]["code"] == 503, events[-2:]
        assert health.status_code == 503 and "replica" in health.json()["error"]["message"]
        assert f"pid {replicas[1]}" in health.json()["error"]["message"]
        assert refused.status_code == 503
        srv.proc.kill()  # no graceful shutdown: the replicas must die with the server
        srv.proc.wait(10)
        assert _wait_gone(family, 10) == []
