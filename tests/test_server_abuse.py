"""The server against hostile or unlucky input (real uvicorn on 127.0.0.1, httpx and the openai
client): invalid Unicode, NaN and absurd numbers, inputs as large as the body limit allows, the
API key on every working route. Each case failed before the fix (500, a frozen event loop, an
open route); see docs/reliability.md for the numbers before and after."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from test_server import MODEL, Running, start

from vmkv.config import EngineConfig
from vmkv.engine.async_engine import AsyncEngine
from vmkv.engine.llm_engine import LLMEngine
from vmkv.server.workers import Workers

pytestmark = pytest.mark.usefixtures("default_model")
KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {**AUTH, "content-type": "application/json"}


@pytest.fixture(scope="module")
def srv() -> Iterator[Running]:
    # the model's own context (8192): the largest prompts that get tokenised at all
    llm = LLMEngine(EngineConfig(max_num_seqs=8, kv_cache_memory=256 << 20))
    engine = AsyncEngine(llm)
    running = start(engine, api_key=KEY)
    yield running
    running.stop()
    engine.shutdown()
    llm.close()


def post(srv: Running, path: str, body: bytes | dict, headers: dict | None = None
         ) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{srv.url}{path}", content=content, headers=headers or JSON, timeout=60)


def assert_error(r: httpx.Response, status: int, param: str | None = None,
                 message: str = "") -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert message in error["message"], error["message"]
    if param is not None:
        assert error["param"] == param, error


# -- invalid Unicode, numbers ------------------------------------------------------------------
@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", "a\\udfffb"], "max_tokens": 2}', "prompt.1"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
     "messages.0.content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", '
     b'"text": "\\udc00"}]}]}', "messages.0.content.0.text"),
    ("/tokenize", b'{"prompt": "a\\ud800b"}', "prompt"),
    ("/v1/completions", b'{"prompt": "x", "stop": ["\\ud800"]}', "stop.0"),
])
def test_lone_surrogates_are_a_400_naming_the_field(srv: Running, path: str, body: bytes,
                                                   param: str) -> None:
    assert_error(post(srv, path, body), 400, param, "lone surrogate")
    ok = post(srv, "/v1/completions", b'{"prompt": "a\\ud83d\\ude00b", "max_tokens": 1}')
    assert ok.status_code == 200  # a valid surrogate pair is an emoji, not an error


@pytest.mark.parametrize(("body", "status", "param", "message"), [
    (b'{"prompt": "x", "temperature": NaN}', 400, None, "NaN is not a valid JSON number"),
    (b'{"prompt": "x", "top_p": Infinity}', 400, None, "Infinity"),
    (b'{"prompt": "x", "presence_penalty": -Infinity}', 400, None, "Infinity"),
    (b'{"prompt": "x", "temperature": 1e999}', 400, None, "out of range"),
    (b'{"prompt": "x", "temperature": 1e9}', 400, "temperature", "[0, 100]"),
    (b'{"prompt": "x", "top_k": 1e30}', 400, "top_k", ""),
    (b'{"prompt": "x", "max_tokens": 1e30}', 400, "max_tokens", ""),
    (b'{"prompt": "x", "cache_salt": ""}', 400, "cache_salt", "non-empty"),
    (b'{"prompt": "x", "stop": ' + json.dumps(["s"] * 65).encode() + b"}", 400, "stop",
     "at most 64"),
    (b'{"prompt": "x", "stop": "' + b"s" * 2000 + b'"}', 400, "stop", "longer than 1024"),
    (b'{"prompt": "x", "stop_token_ids": ' + json.dumps([1] * 65).encode() + b"}", 400,
     "stop_token_ids", "at most 64"),
    (b'\xff\xfe{"prompt": "x"}', 400, None, "malformed JSON"),
])
def test_non_finite_and_absurd_numbers_are_refused(srv: Running, body: bytes, status: int,
                                                   param: str | None, message: str) -> None:
    assert_error(post(srv, "/v1/completions", body), status, param, message)


def test_absurd_but_harmless_values_are_clamped_as_documented(srv: Running) -> None:
    # top_k at or above the vocabulary keeps every token: the same as top_k=0
    body = {"prompt": "Hello", "max_tokens": 4, "seed": 5, "temperature": 0.8}
    off = post(srv, "/v1/completions", {**body, "top_k": 0}).json()["choices"][0]["text"]
    huge = post(srv, "/v1/completions", {**body, "top_k": 10**30}).json()["choices"][0]["text"]
    assert huge == off


# -- the API key ---------------------------------------------------------------------------
@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("POST", "/reset_prefix_cache"),
    ("GET", "/no/such/route"),
])
def test_every_working_route_needs_the_key(srv: Running, method: str, path: str) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                    {"Authorization": f"Basic {KEY}"}):
        r = httpx.request(method, f"{srv.url}{path}", headers=headers, json={"prompt": "x"})
        assert_error(r, 401, message="API key")


@pytest.mark.parametrize("path", ["/health", "/version", "/metrics", "/openapi.json", "/docs"])
def test_probes_and_docs_stay_open(srv: Running, path: str) -> None:
    assert httpx.get(f"{srv.url}{path}").status_code == 200


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_the_bearer_scheme_is_case_insensitive(srv: Running, scheme: str) -> None:
    r = httpx.post(f"{srv.url}/tokenize", headers={"Authorization": f"{scheme}  {KEY}"},
                   json={"prompt": "Hello world"})
    assert r.status_code == 200 and r.json()["count"] == 2


def test_models_show_no_local_path(srv: Running) -> None:
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0)
    (model,) = client.models.list().data
    assert model.id == MODEL and model.model_extra["root"] == "SmolLM2-135M-Instruct"
    assert "/" not in httpx.get(f"{srv.url}/v1/models", headers=AUTH).text.replace(
        '"object":"list"', "")


# -- inputs as large as the body limit allows ----------------------------------------------
LIMIT = 4 << 20


@pytest.mark.parametrize(("name", "body", "param", "message"), [
    ("4 MiB of text", json.dumps({"prompt": "hello world " * (LIMIT // 12 - 10)}).encode(),
     "prompt", "characters, more than the"),
    ("2M token ids", b'{"prompt": [' + b",".join([b"1"] * (LIMIT // 2 - 20)) + b"]}",
     "prompt", "token ids; at most 8192"),
    ("1M prompts", b'{"prompt": [' + b",".join([b"[1]"] * (LIMIT // 4 - 20)) + b"]}",
     "prompt", "prompts in one request; at most 1024"),
    ("4 MiB of messages", json.dumps({"messages": [{"role": "user", "content": ""}]
                                      * (LIMIT // 34 - 10)}).encode(),
     "messages", "messages can never fit"),
    ("1M ids to detokenize", b'{"tokens": [' + b",".join([b"7"] * (LIMIT // 2 - 20)) + b"]}",
     "tokens", "at most 131072"),
])
def test_the_largest_bodies_are_refused_before_tokenising(srv: Running, name: str, body: bytes,
                                                         param: str, message: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    assert len(body) <= LIMIT
    path = "/detokenize" if name.startswith("1M ids") else (
        "/v1/chat/completions" if "messages" in name else "/v1/completions")
    jobs = TokenizerJobs(monkeypatch)
    assert_error(post(srv, path, body), 400, param, message)
    assert jobs.snapshot() == (0, 0)  # refused by its size: 3.9 MB of text was tokenised first


class TokenizerJobs:
    """Counts the server's tokenizer jobs (every one goes through ``Workers.run``) while the
    test runs: how many started and how many finished."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.started = self.finished = 0
        self._lock = threading.Lock()
        run = Workers.run

        async def counted(workers: Workers, fn: Callable[..., Any], *args: Any,
                          **kwargs: Any) -> Any:
            def job() -> Any:
                with self._lock:
                    self.started += 1
                try:
                    return fn(*args, **kwargs)
                finally:
                    with self._lock:
                        self.finished += 1

            return await run(workers, job)

        monkeypatch.setattr(Workers, "run", counted)

    def snapshot(self) -> tuple[int, int]:
        """(started, finished) now."""
        with self._lock:
            return self.started, self.finished


def test_health_and_metrics_answer_while_4_mb_of_prompts_are_tokenised(
        srv: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    # each prompt is the largest that passes the character limit (8192 tokens x the longest
    # token, 81 characters): six of them (4.0 MB of text, what the 4 MiB body limit allows in
    # flight at once) go through the worker pool
    text = "Ab, " * (8192 * 81 // 4 - 1)
    results: list[int] = []
    jobs = TokenizerJobs(monkeypatch)

    def flood() -> None:
        async def one(client: httpx.AsyncClient) -> int:
            r = await client.post(f"{srv.url}/tokenize", json={"prompt": text}, headers=AUTH)
            return r.status_code if r.status_code != 200 else r.json()["count"]

        async def main() -> list[int]:
            async with httpx.AsyncClient(timeout=300) as client:
                return await asyncio.gather(*(one(client) for _ in range(6)))

        results.extend(asyncio.run(main()))

    busy = threading.Thread(target=flood)
    # answers given while a tokenisation ran from before the request was sent until after its
    # answer arrived: a loop blocked by tokenising (the bug: 2.6 s stalls) could give none
    during = {"/health": 0, "/metrics": 0}
    with httpx.Client(timeout=300) as client:
        busy.start()
        while busy.is_alive():
            for path in during:
                started, finished = jobs.snapshot()
                assert client.get(f"{srv.url}{path}").status_code == 200
                if started > finished and jobs.snapshot()[1] == finished:
                    during[path] += 1
            time.sleep(0.02)
        busy.join()
    assert results == [len(text) // 2 + 1] * 6  # "Ab", ","; all six really tokenised
    assert jobs.snapshot() == (6, 6)
    assert min(during.values()) >= 3, during


def test_the_worker_pools_are_bounded() -> None:
    from vmkv.server.limits import InputLimits
    from vmkv.server.workers import ServerBusyError

    workers = Workers(None, InputLimits(16, 100, 1000), max_pending=2, max_pending_bytes=100,
                      inline_bytes=10)
    release = threading.Event()

    async def main() -> None:
        blocked = [asyncio.ensure_future(workers.run(release.wait)) for _ in range(2)]
        await asyncio.sleep(0.1)
        with pytest.raises(ServerBusyError, match="thread pool full"):
            await workers.run(time.sleep, 0)
        release.set()
        assert await asyncio.gather(*blocked) == [True, True]
        assert await workers.run(lambda: 7) == 7  # room again
        body = b'{"tokens": [' + b"1," * 24 + b'1]}'  # 62 B: parsed in the worker process
        first, second = await asyncio.gather(
            *(workers.parse(body, DetokenizeRequest) for _ in range(2)), return_exceptions=True)
        assert first.tokens == [1] * 25 and isinstance(second, ServerBusyError)

    from vmkv.server.protocol import DetokenizeRequest

    asyncio.run(main())
    workers.close()
