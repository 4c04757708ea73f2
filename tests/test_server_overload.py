"""The server under overload and faults (real uvicorn on 127.0.0.1, httpx): a bounded queue
(503 + Retry-After), per-request deadlines, refused memory pages, a dying engine, a soak with
disconnects and preemption, and idle KV memory going back to the operating system."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import threading
from collections.abc import Callable, Iterator
from contextlib import AsyncExitStack
from typing import Any, TypeVar

import httpx
import psutil
import pytest
import serving
from prometheus_client.parser import text_string_to_metric_families
from test_server import Running, start, wait_idle

from vmkv.config import EngineConfig
from vmkv.engine.async_engine import AsyncEngine
from vmkv.engine.llm_engine import LLMEngine
from vmkv.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("default_model")
T = TypeVar("T")


def on_engine(srv: Running, fn: Callable[[LLMEngine], Any]) -> Any:
    """``fn(engine)`` on the engine thread, between steps, from the test's thread."""
    loop = srv.server.servers[0].get_loop()
    return asyncio.run_coroutine_threadsafe(srv.engine.call(fn), loop).result(timeout=60)


def serve(**config: Any) -> Callable[..., Running]:
    """A fixture factory: an engine with ``engine`` options and a server with the rest."""
    engine_options = config.pop("engine")

    @pytest.fixture(scope="module")
    def fixture() -> Iterator[Running]:
        yield from serving.serve(EngineConfig(**engine_options), **config)

    return fixture


async def complete(client: httpx.AsyncClient, url: str, body: dict,
                   leave_after: int | None = None) -> tuple[int, list[Any], dict]:
    """Status, events (streamed) or ``[json]``, and headers; ``leave_after`` events: disconnect."""
    if not body.get("stream"):
        r = await client.post(f"{url}/v1/completions", json=body)
        return r.status_code, [r.json()], dict(r.headers)
    events: list[Any] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            return r.status_code, [json.loads(await r.aread())], dict(r.headers)
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
                if leave_after is not None and len(events) >= leave_after:
                    return -1, events, dict(r.headers)
    return r.status_code, events, dict(r.headers)


def rejected(url: str) -> dict[str, float]:
    """``vmkv:requests_rejected_total`` by reason."""
    text = httpx.get(f"{url}/metrics").text
    return {s.labels["reason"]: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == "vmkv:requests_rejected_total"}


def run_all(coros: Callable[[httpx.AsyncClient], list]) -> list:
    async def main() -> list:
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*coros(client))

    return asyncio.run(main())


def text_of(body: dict, events: list[Any]) -> str:
    if not body.get("stream"):
        return events[0]["choices"][0]["text"]
    return "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict)
                   and e.get("choices"))


# -- backpressure and deadlines --------------------------------------------------------------
@pytest.fixture(scope="module")
def two_seqs() -> Iterator[AsyncEngine]:
    # a long context, so that a request can ask for more tokens than any machine makes before
    # a deadline (pages are mapped as tokens come: the length costs no memory)
    llm = LLMEngine(EngineConfig(max_model_len=4096, max_num_seqs=2))
    engine = AsyncEngine(llm)
    yield engine
    engine.shutdown()
    llm.close()


def test_a_cancelled_add_aborts_the_request_it_queued(two_seqs: AsyncEngine) -> None:
    """A caller cancelled while the engine queues its request (a client gone, a pool busy)
    leaves nothing running: the request is aborted the moment it is queued."""
    def finished(engine: LLMEngine) -> tuple[dict[str, int], list[str]]:
        return dict(engine.counters.finished), list(engine.requests)

    async def main() -> tuple[dict[str, int], dict[str, int], list[str]]:
        before, _ = await two_seqs.call(finished)
        gate = threading.Event()  # holds the engine thread until the add is cancelled
        blocker = asyncio.ensure_future(two_seqs.call(lambda _: gate.wait(30)))
        add = asyncio.ensure_future(two_seqs.add("cancelled", [1, 2, 3], SamplingParams(
            max_tokens=200, ignore_eos=True)))
        await asyncio.sleep(0.1)  # the Add waits in the engine's inbox
        add.cancel()
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await add
        await blocker
        after, running = await two_seqs.call(finished)
        return before, after, running

    before, after, running = asyncio.run(main())
    assert running == [] and after["abort"] == before["abort"] + 1
    assert after["length"] == before["length"]  # it did not run to max_tokens


def test_a_full_queue_answers_503_with_retry_after(two_seqs: AsyncEngine) -> None:
    busy = start(two_seqs, max_waiting_requests=2)
    body = {"prompt": "Count to a hundred:", "max_tokens": 4000, "ignore_eos": True,
            "temperature": 0, "stream": True}  # runs for minutes: nothing leaves the queue

    async def main() -> tuple[list[int], list[tuple[dict, httpx.Headers]]]:
        statuses, errors = [], []
        async with httpx.AsyncClient(timeout=300) as client, AsyncExitStack() as streams:
            # one at a time: each is queued (a stream starts) or refused before the next is
            # sent, so what fills up is the engine's queue (--max-waiting-requests), never the
            # tokenizer pool (bounded by the same number: "busy" when sent all at once)
            for _ in range(10):
                r = await streams.enter_async_context(
                    client.stream("POST", f"{busy.url}/v1/completions", json=body))
                statuses.append(r.status_code)
                if r.status_code != 200:
                    errors.append((json.loads(await r.aread()), r.headers))
        return statuses, errors  # leaving the stack disconnected the admitted streams

    try:
        statuses, errors = asyncio.run(main())
        served, refused = statuses.count(200), statuses.count(503)
        # 2 running + at most 2 waiting (the first two may still wait when more arrive)
        assert served + refused == 10 and 2 <= served <= 4, statuses
        for error, headers in errors:
            assert headers["retry-after"] == "1" and "overloaded" in error["error"]["message"]
        assert rejected(busy.url) == {"queue_full": refused}
        assert wait_idle(busy.url)["vmkv:kv_physical_bytes_in_use"] == 0  # aborted, freed
    finally:
        busy.stop()


def test_a_request_past_its_deadline_is_aborted_with_a_clean_end(two_seqs: AsyncEngine
                                                                 ) -> None:
    busy = start(two_seqs, request_timeout=2.0)
    try:
        _check_deadline(busy)
    finally:
        busy.stop()


def _check_deadline(busy: Running) -> None:
    before = wait_idle(busy.url)
    # cannot finish before the 2 s deadline on any machine: 4,000 tokens, no early EOS
    body = {"prompt": "Tell me everything:", "max_tokens": 4000, "ignore_eos": True}
    (status, (plain,), _), (_, events, _) = run_all(lambda c: [
        complete(c, busy.url, body), complete(c, busy.url, {**body, "stream": True})])
    assert status == 200
    choice = plain["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("abort", "timeout")
    assert plain["usage"]["completion_tokens"] < 4000  # what came before the deadline
    last = [e for e in events if isinstance(e, dict)][-1]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("abort", "timeout")
    assert events[-1] == "[DONE]"
    after = wait_idle(busy.url)
    assert after["vmkv:request_timeouts_total"] - before.get("vmkv:request_timeouts_total",
                                                             0) == 2
    assert after["vmkv:kv_physical_bytes_in_use"] == 0


# -- refused memory pages over HTTP ----------------------------------------------------------
PROMPTS = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(6)]
tight = serve(engine=dict(max_model_len=128, max_num_seqs=6, kv_cache_memory=4 << 20,
                          max_idle_memory=0, enable_prefix_caching=False))


def test_refused_pages_fail_their_requests_cleanly_and_spare_the_others(tight: Running) -> None:
    def bodies() -> list[dict]:
        return [{"prompt": p, "max_tokens": 20, "ignore_eos": True, "temperature": 0,
                 "stream": i % 2 == 0} for i, p in enumerate(PROMPTS)]

    clean = [text_of(b, r[1]) for b, r in zip(bodies(), run_all(
        lambda c: [complete(c, tight.url, b) for b in bodies()]), strict=True)]
    on_engine(tight, lambda e: e.kv.backend.faults.arm("map", "ENOMEM", after=4))
    on_engine(tight, lambda e: e.kv.backend.faults.arm("create", "EPERM", after=9))
    results = run_all(lambda c: [complete(c, tight.url, b) for b in bodies()])
    fired = on_engine(tight, lambda e: dict(e.kv.backend.faults.fired))
    failed = 0
    for i, (status, events, _) in enumerate(results):
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        if errors:  # non-streaming: HTTP 503; streaming: an error event, then [DONE]
            failed += 1
            assert status == (200 if i % 2 == 0 else 503)
            assert "KV cache memory error" in errors[0]["error"]["message"]
            assert errors[0]["error"]["code"] == 503
            if i % 2 == 0:
                assert events[-1] == "[DONE]"
        else:
            assert text_of(bodies()[i], events) == clean[i], f"request {i} changed"
    assert failed == fired["map"] + fired["create"] >= 1
    on_engine(tight, lambda e: e.kv.accounting.check())  # the page accounting is exact
    assert wait_idle(tight.url)["vmkv:kv_physical_bytes_in_use"] == 0


# -- a step that raises: the engine is dead, every client hears it ----------------------------
def test_a_failing_model_step_ends_every_request_with_an_error() -> None:
    llm = LLMEngine(EngineConfig(max_model_len=128, max_num_seqs=4))
    engine = AsyncEngine(llm)
    srv = start(engine)
    try:
        steps = {"n": 0}
        execute = llm.executor.execute

        def failing(out: Any) -> Any:  # the model breaks a few steps in (a device error)
            steps["n"] += 1
            if steps["n"] > 6:
                raise RuntimeError("simulated device failure")
            return execute(out)

        llm.executor.execute = failing
        body = {"prompt": "Go on:", "max_tokens": 100, "ignore_eos": True}
        results = run_all(lambda c: [complete(c, srv.url, {**body, "stream": i < 2})
                                     for i in range(4)])
        for i, (status, events, _) in enumerate(results):
            error = [e for e in events if isinstance(e, dict) and "error" in e][0]["error"]
            assert error["code"] == 503 and "engine loop died" in error["message"]
            if status == 200:  # a stream that had started: an error event, then [DONE]
                assert i < 2 and events[-1] == "[DONE]"
            else:
                assert status == 503
        assert httpx.get(f"{srv.url}/health").status_code == 503
        r = httpx.post(f"{srv.url}/v1/completions", json=body)
        assert r.status_code == 503 and "engine loop died" in r.json()["error"]["message"]
        assert steps["n"] == 7  # nothing ran after the failure
        engine._thread.join(10)
        for request_id in list(llm.requests):  # the dead engine's requests free everything
            llm.abort_request(request_id)
        llm.kv.accounting.check()
        assert llm.kv.accounting.usage.bytes_in_use == 0
    finally:
        srv.stop()
        llm.close()


# -- a soak: disconnects, timeouts and preemption under tight memory ------------------------
soak = serve(engine=dict(max_model_len=256, max_num_seqs=16, kv_cache_memory=12 << 20),
             max_waiting_requests=64)


@pytest.mark.slow  # ~30 s on an idle 2-core machine
def test_soak_with_disconnects_and_preemption_leaks_nothing(soak: Running) -> None:
    rng = random.Random(300)
    shared = "You are a helpful assistant. Answer briefly and precisely. " * 3

    def body(i: int) -> dict:
        prompt = (shared if i % 3 == 0 else "") + f"Request {i}: " + "word " * rng.randrange(4, 30)
        return {"prompt": prompt, "max_tokens": rng.randrange(3, 12), "ignore_eos": True,
                "temperature": 0.7, "seed": i, "stream": i % 2 == 0}

    def batch(n: int, first: int) -> list[tuple[dict, int | None]]:
        return [(body(first + i), 2 if rng.random() < 0.3 else None) for i in range(n)]

    async def bounded(client: httpx.AsyncClient, jobs: list, limit: int) -> list:
        gate = asyncio.Semaphore(limit)

        async def one(b: dict, leave: int | None) -> Any:
            async with gate:
                if leave is not None and not b["stream"]:  # a client that gives up waiting
                    with contextlib.suppress(httpx.ReadTimeout):  # (long: it rarely finishes)
                        await client.post(f"{soak.url}/v1/completions",
                                          json={**b, "max_tokens": 160}, timeout=0.3)
                    return -1, [], {}
                return await complete(client, soak.url, b, leave)

        return await asyncio.gather(*(one(b, leave) for b, leave in jobs))

    run_all(lambda c: [bounded(c, batch(12, 0), 12)])  # warm-up: every worker thread exists
    wait_idle(soak.url)
    threads = threading.active_count()
    children = len(psutil.Process().children(recursive=True))
    jobs = batch(300, 1000)
    (results,) = run_all(lambda c: [bounded(c, jobs, 24)])
    m = wait_idle(soak.url, timeout=120)
    left = sum(1 for _, leave in jobs if leave is not None)
    assert 60 <= left <= 120
    for (b, leave), (status, events, _) in zip(jobs, results, strict=True):
        if leave is None:
            assert status == 200, events
            if b["stream"]:
                assert events[-1] == "[DONE]"
    assert m["vllm:num_preemptions_total"] > 0  # the memory was tight enough to preempt
    assert m["vmkv:kv_physical_bytes_in_use"] == 0 and m["vllm:kv_cache_usage_perc"] == 0
    on_engine(soak, lambda e: e.kv.accounting.check())
    assert on_engine(soak, lambda e: (len(e.requests), e.scheduler.has_work())) == (0, False)
    assert threading.active_count() == threads  # no thread, no process left behind
    assert len(psutil.Process().children(recursive=True)) == children


# -- elastic memory: what the OS holds for the KV pool returns to the idle budget -------------
BUDGET = 16 << 20
elastic = serve(engine=dict(max_model_len=512, max_num_seqs=16, max_idle_memory=BUDGET))


def test_idle_kv_memory_returns_to_the_os_prefix_cache_included(elastic: Running) -> None:
    base = "You are a careful assistant. " * 40  # ~240 tokens shared by every request

    def body(i: int) -> dict:
        return {"prompt": f"{base} Question {i}: " + "why " * (20 + 10 * i), "max_tokens": 8,
                "temperature": 0}

    run_all(lambda c: [complete(c, elastic.url, body(i)) for i in range(16)])
    m = wait_idle(elastic.url)
    page = 16 << 10  # the anchor page (per-layer layout on CPU)
    # ~16 x 450 tokens x 45 KiB were allocated during the burst; 16 MiB + one page remain
    assert m["vmkv:kv_pool_allocated_bytes"] <= BUDGET + page
    assert 0 < m["vmkv:kv_prefix_cached_bytes"] <= BUDGET  # the cache kept what fits ...
    again = run_all(lambda c: [complete(c, elastic.url, body(15))])[0][1][0]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # ... and it hits
    assert wait_idle(elastic.url)["vmkv:kv_pool_allocated_bytes"] <= BUDGET + page
