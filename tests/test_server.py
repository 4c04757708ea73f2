"""The HTTP server, really listening on 127.0.0.1, driven by the real `openai` client and httpx."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from vmkv import LLM, SamplingParams
from vmkv.bench.launch import free_port
from vmkv.config import EngineConfig, ServerConfig
from vmkv.cpu_info import bf16_hardware
from vmkv.engine.async_engine import AsyncEngine
from vmkv.engine.llm_engine import LLMEngine
from vmkv.server.app import build_app, served_name

pytestmark = pytest.mark.usefixtures("default_model")
MODEL = "smol"


@dataclass
class Running:
    url: str
    engine: AsyncEngine
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def start(engine: AsyncEngine, **config: object) -> Running:
    """Serve ``engine`` on a free port with ``ServerConfig(**config)`` (``dev_mode=True``: with
    the development routes)."""
    app = build_app(engine, ServerConfig(**{"served_model_name": MODEL, **config}))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return Running(url, engine, server, thread)
        except httpx.TransportError:
            time.sleep(0.05)
    raise RuntimeError("server did not start")


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncEngine]:
    llm = LLMEngine(EngineConfig(max_model_len=256, max_num_seqs=40,
                                 enable_prefix_caching=True))
    eng = AsyncEngine(llm)
    yield eng
    eng.shutdown()
    llm.close()


@pytest.fixture(scope="module")
def srv(engine: AsyncEngine) -> Iterator[Running]:
    running = start(engine, dev_mode=True)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(srv: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name
            if "finished_reason" in sample.labels:
                key += f"{{{sample.labels['finished_reason']}}}"
            values[key] = sample.value
    return values


def wait_idle(url: str, timeout: float = 30) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0:
            return m
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.1)


# -- the openai client ----------------------------------------------------------------------------
def test_models_health_version(srv: Running, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = httpx.get(f"{srv.url}/health")
    assert health.status_code == 200
    kernels = {"attention": "compiled", "argmax": "compiled", "decoder_layers": "compiled",
               "quant_layers": "compiled"}
    if bf16_hardware():  # the bfloat16 layers exist only there
        kernels["bf16_layers"] = "compiled"
    assert health.json() == {"status": "ok", "cpu_kernels": kernels}  # which C++ kernels run
    assert httpx.get(f"{srv.url}/version").json()["version"]


def test_the_model_is_served_under_its_name_unless_one_is_given(engine: AsyncEngine) -> None:
    assert build_app(engine, ServerConfig()).state.metrics.model_name == "SmolLM2-135M-Instruct"
    assert served_name("/models/Llama-3.2-1B") == "Llama-3.2-1B"


def test_greedy_completion_equals_the_offline_api(client: openai.OpenAI) -> None:
    prompts = ["The capital of France is", "def add(a, b):"]
    llm = LLM(max_model_len=256)
    want = [o.outputs[0].text for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)]
    llm.engine.close()
    for prompt, text in zip(prompts, want, strict=True):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        assert r.choices[0].text == text
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens > 0
    many = client.completions.create(model=MODEL, prompt=prompts, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(many.choices, key=lambda c: c.index)] == want


def test_streaming_completion_and_chat(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16,
                                     temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time",
                                            max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 16 and chunks[-1].choices == []
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                          temperature=0)
    assert "Paris" in chat.choices[0].message.content
    stream = list(client.chat.completions.create(model=MODEL, messages=messages,
                                                 max_tokens=16, temperature=0, stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == (
        chat.choices[0].message.content)


def test_n_seed_stop_and_logprobs(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt="My favourite animal is", max_tokens=10, temperature=1.0)
    two = client.completions.create(n=2, seed=3, **kw)
    assert sorted(c.index for c in two.choices) == [0, 1]
    again = client.completions.create(n=2, seed=3, **kw)
    assert [c.text for c in two.choices] == [c.text for c in again.choices]  # reproducible
    other = client.completions.create(n=2, seed=4, **kw)
    assert [c.text for c in other.choices] != [c.text for c in two.choices]
    base = client.completions.create(model=MODEL, prompt="The capital of France is",
                                     max_tokens=12, temperature=0).choices[0].text
    cut = client.completions.create(model=MODEL, prompt="The capital of France is",
                                    max_tokens=12, temperature=0, stop=["ari"]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == base[: base.index("ari")]
    lp = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0,
                                   logprobs=2).choices[0].logprobs
    assert len(lp.tokens) == 3 and all(v <= 0 for v in lp.token_logprobs)
    assert all(len(t) == 2 for t in lp.top_logprobs)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
        temperature=0, logprobs=True, top_logprobs=2,
        extra_body={"top_k": 5, "min_tokens": 2, "ignore_eos": True})
    assert len(chat.choices[0].logprobs.content) == 3
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 2


def test_prefix_cache_hits_show_in_usage_and_salts_isolate(srv: Running,
                                                           client: openai.OpenAI) -> None:
    system = "You are a terse assistant who answers in one word. " * 8
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Sky?"}]
    kw = dict(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    first = client.chat.completions.create(**kw, extra_body={"cache_salt": "t1"})
    again = client.chat.completions.create(**kw, extra_body={"cache_salt": "t1"})
    other = client.chat.completions.create(**kw, extra_body={"cache_salt": "t2"})
    assert again.usage.prompt_tokens_details.cached_tokens > 64
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # another tenant
    assert again.choices[0].message.content == first.choices[0].message.content
    m = metrics(srv.url)
    assert m["vllm:prefix_cache_hits_total"] > 0
    assert m["vllm:prefix_cache_queries_total"] > m["vllm:prefix_cache_hits_total"]
    reset = httpx.post(f"{srv.url}/reset_prefix_cache")
    assert reset.status_code == 200 and reset.json()["dropped_units"] > 0
    cold = client.chat.completions.create(**kw, extra_body={"cache_salt": "t1"})
    assert cold.usage.prompt_tokens_details.cached_tokens == 0


def test_tokenize_detokenize(srv: Running) -> None:
    ids = httpx.post(f"{srv.url}/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    assert httpx.post(f"{srv.url}/detokenize", json={"tokens": ids}).json()["prompt"] == (
        "Hello world")


# -- load, disconnects, metrics -------------------------------------------------------------------
def test_concurrent_streams_with_disconnects_free_their_pages(srv: Running) -> None:
    before = wait_idle(srv.url)

    async def one(i: int, client: httpx.AsyncClient) -> int:
        body = {"model": MODEL, "prompt": f"Story number {i}:", "max_tokens": 40,
                "temperature": 0.8, "seed": i, "stream": True, "ignore_eos": True}
        chunks = 0
        async with client.stream("POST", f"{srv.url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                chunks += 1
                if i < 8 and chunks == 3:
                    return -1  # leave mid-stream: closing the response disconnects
                if line == "data: [DONE]":
                    return chunks
        return chunks

    async def main() -> list[int]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(i, client) for i in range(32)))

    results = asyncio.run(main())
    assert results[:8] == [-1] * 8 and all(r > 3 for r in results[8:])
    after = wait_idle(srv.url)
    assert after["vmkv:kv_physical_bytes_in_use"] == 0
    assert after["vllm:request_success_total{abort}"] - before.get(
        "vllm:request_success_total{abort}", 0) == 8
    assert after["vllm:generation_tokens_total"] > before["vllm:generation_tokens_total"]
    assert after["vllm:time_to_first_token_seconds_count"] > before.get(
        "vllm:time_to_first_token_seconds_count", 0)
    assert after["vmkv:kv_map_calls_total"] > 0  # the virtual mode mapped pages


def test_non_streaming_client_disconnect_aborts(srv: Running) -> None:
    wait_idle(srv.url)
    before = metrics(srv.url).get("vllm:request_success_total{abort}", 0)
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": 200, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{srv.url}/v1/completions", json=body, timeout=0.5)
    after = wait_idle(srv.url)
    assert after["vllm:request_success_total{abort}"] == before + 1
    assert after["vmkv:kv_physical_bytes_in_use"] == 0


# -- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": 1000}, 400, None),
        ("/v1/completions", {"prompt": "word " * 300}, 400, None),
        ("/v1/completions", {"prompt": "x", "n": 99}, 400, "n"),
        ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
        ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": [1, 2, 10**9]}, 400, "prompt"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, None),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ],
)
def test_bad_requests_get_openai_errors(srv: Running, path: str, body: dict, status: int,
                                        param: str | None) -> None:
    r = httpx.post(f"{srv.url}{path}", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] is not None and param in error["param"]
    assert httpx.get(f"{srv.url}/health").status_code == 200  # still serving


def test_malformed_json_and_body_limit_and_api_key(engine: AsyncEngine) -> None:
    guarded = start(engine, dev_mode=True, api_key="s3cret", max_body_bytes=2048)
    try:
        url = guarded.url
        ok = {"Authorization": "Bearer s3cret"}
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
        r = httpx.post(f"{url}/v1/completions", headers={"Authorization": "Bearer nope"},
                       json={"prompt": "x"})
        assert r.status_code == 401
        r = httpx.post(f"{url}/v1/completions", headers={**ok, "content-type":
                                                         "application/json"}, content=b"{bad")
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/completions", headers=ok, json={"prompt": "x" * 5000})
        assert r.status_code == 413 and r.json()["error"]["code"] == 413
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        assert httpx.get(f"{url}/health").status_code == 200  # health needs no key
        assert httpx.post(f"{url}/reset_prefix_cache").status_code == 401
        assert httpx.post(f"{url}/reset_prefix_cache", headers=ok).status_code == 200
    finally:
        guarded.stop()


def test_metrics_parse_and_count(srv: Running, client: openai.OpenAI) -> None:
    before = wait_idle(srv.url)
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0)
    after = wait_idle(srv.url)
    assert after["vllm:generation_tokens_total"] == before["vllm:generation_tokens_total"] + 5
    assert after["vllm:prompt_tokens_total"] > before["vllm:prompt_tokens_total"]
    assert after["vllm:e2e_request_latency_seconds_count"] == (
        before["vllm:e2e_request_latency_seconds_count"] + 1)
    assert after["vmkv:kv_virtual_reserved_bytes"] > 0 and after["vmkv:kv_capacity_bytes"] > 0
    assert 0 <= after["vllm:kv_cache_usage_perc"] <= 1


def test_health_reports_a_dead_engine() -> None:
    llm = LLMEngine(EngineConfig(max_model_len=64, max_num_seqs=2))
    eng = AsyncEngine(llm)
    running = start(eng)
    try:
        def broken_step() -> list:
            raise RuntimeError("simulated device failure")

        llm.step = broken_step
        r = httpx.post(f"{running.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code in (500, 503) and "error" in r.json()
        assert httpx.get(f"{running.url}/health").status_code == 503
        r = httpx.post(f"{running.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503
    finally:
        running.stop()
        llm.close()
