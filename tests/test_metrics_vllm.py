"""``/metrics`` under vLLM's names: every query of vLLM's Grafana dashboard resolves, every
metric vLLM's Prometheus logger defines is there with its label set, the HTTP metrics are
prometheus-fastapi-instrumentator's, and the request phases add up (tests/data/vllm_metrics.json
says where each list came from). A real server on 127.0.0.1 and the real openai client."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving import client_of, serve
from test_server import MODEL, Running

from vmkv.config import EngineConfig

pytestmark = pytest.mark.usefixtures("default_model")
DATA = json.loads((Path(__file__).parent / "data" / "vllm_metrics.json").read_text())
SELECTOR = re.compile(r"(vllm:[a-z0-9_]+)(?:\{([^}]*)\})?")
MATCHER = re.compile(r'([a-z_]+)="([^"]*)"')


@pytest.fixture(scope="module")
def srv() -> Iterator[Running]:
    yield from serve(EngineConfig(max_model_len=256, enable_prefix_caching=True))


@pytest.fixture(scope="module")
def scrape(srv: Running) -> list:
    """The samples of /metrics after a completion, a streamed chat with n=2 and a 404."""
    client = client_of(srv)
    client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5,
                              temperature=0)
    list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, n=2,
        stream=True, temperature=1.0, seed=1))
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    httpx.get(f"{srv.url}/health")
    return samples(srv.url)


def samples(url: str) -> list:
    return [s for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
            for s in f.samples]


def resolves(found: list, query: str) -> list[str]:
    """The selectors of ``query`` (with ``$model_name`` the served name) that match no
    sample of ``found``."""
    missing = []
    for name, matchers in SELECTOR.findall(query):
        want = {k: MODEL if v == "$model_name" else v for k, v in MATCHER.findall(matchers)}
        if not any(s.name == name and want.items() <= s.labels.items()
                   and ("le" in s.labels or not name.endswith("_bucket")) for s in found):
            missing.append(name)
    return missing


@pytest.mark.parametrize("dashboard", ["grafana", "grafana_before_itl"])
def test_every_grafana_query_of_vllm_resolves(scrape: list, dashboard: str) -> None:
    queries = DATA[dashboard]["queries"]
    assert len(queries) > 4
    assert {q: resolves(scrape, q) for q in queries if resolves(scrape, q)} == {}
    by_reason = {s.labels["finished_reason"] for s in scrape
                 if s.name == "vllm:request_success_total"}
    assert {"stop", "length", "abort"} <= by_reason  # the Finish Reason panel's series


def test_every_metric_of_vllms_logger_has_its_type_and_labels(srv: Running) -> None:
    families = {f.name: f for f in text_string_to_metric_families(
        httpx.get(f"{srv.url}/metrics").text)}
    for name, (kind, extra) in DATA["prometheus_logger"]["metrics"].items():
        assert name in families, name
        family = families[name]
        assert family.type == kind, name
        assert family.samples, name
        for s in family.samples:
            assert {"model_name", "engine", *extra} <= set(s.labels), (name, s.labels)
            assert s.labels["model_name"] == MODEL and s.labels["engine"] == "0"


def test_http_metrics_are_the_instrumentators(scrape: list) -> None:
    for name, (_, labels) in DATA["http"]["metrics"].items():
        assert any(s.name.startswith(name) and set(labels) <= set(s.labels)
                   for s in scrape), name
    requests = {(s.labels["handler"], s.labels["status"]): s.value for s in scrape
                if s.name == "http_requests_total"}
    assert requests[("/v1/completions", "2xx")] >= 1
    assert requests[("/v1/completions", "4xx")] >= 1  # the unknown model
    assert requests[("/v1/chat/completions", "2xx")] >= 1
    assert not any(h in ("/metrics", "/health") for h, _ in requests)  # probes: uncounted


def test_the_request_phases_add_up_and_each_request_counts_once(srv: Running) -> None:
    def sums() -> dict[str, float]:
        return {s.name: s.value for s in samples(srv.url)
                if s.name.endswith(("_sum", "_count")) and s.name.startswith("vllm:")}

    before = sums()
    client_of(srv).completions.create(model=MODEL, prompt=["One two", "Three"], max_tokens=6,
                                      temperature=0, n=2)
    after = sums()

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    for phase in ("e2e_request_latency", "request_queue_time", "request_prefill_time",
                  "request_decode_time", "request_inference_time"):
        assert grew(f"vllm:{phase}_seconds_count") == 2, phase  # one per prompt
    # the engine's phases: queue + inference = its whole stay, inside the server's end to end
    inference = grew("vllm:request_inference_time_seconds_sum")
    assert inference == pytest.approx(grew("vllm:request_prefill_time_seconds_sum")
                                      + grew("vllm:request_decode_time_seconds_sum"))
    assert grew("vllm:request_queue_time_seconds_sum") + inference <= grew(
        "vllm:e2e_request_latency_seconds_sum")
    assert grew("vllm:request_generation_tokens_sum") == 2 * 2 * 6  # 2 prompts x n=2 x 6
    assert grew("vllm:request_max_num_generation_tokens_sum") == 2 * 6
    assert grew("vllm:request_params_n_sum") == 2 * 2
    assert grew("vllm:request_params_max_tokens_sum") == 2 * 6
    assert grew("vllm:iteration_tokens_total_count") >= 6  # at least one step per token
    assert grew("vllm:iteration_tokens_total_sum") >= grew("vllm:request_prompt_tokens_sum")
