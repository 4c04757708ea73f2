"""`vmkv bench serve` against a real server: in-process uvicorn on 127.0.0.1, and --launch."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from test_server import start

from vmkv.bench import serve, serve_metrics
from vmkv.bench.serve_metrics import RequestResult
from vmkv.bench.workloads import WorkloadSpec, for_tokenizer
from vmkv.cli import main
from vmkv.config import EngineConfig
from vmkv.engine.async_engine import AsyncEngine
from vmkv.engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def server(default_model: Path) -> Iterator[tuple[str, LLMEngine]]:
    llm = LLMEngine(EngineConfig(max_model_len=128, max_num_seqs=8, kv_cache_memory=64 << 20))
    engine = AsyncEngine(llm)
    running = start(engine)  # serves the model as "smol"
    yield running.url, llm
    running.stop()
    engine.shutdown()
    llm.close()


def _requests(llm: LLMEngine, n: int = 4) -> list:
    spec = WorkloadSpec("random", num_prompts=n, input_len=(8, 16), output_len=(4, 10), seed=5)
    return for_tokenizer(spec, llm.tokenizer, llm.model_config.vocab_size)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_streams_every_request_and_counts_exact_tokens(server: tuple[str, LLMEngine],
                                                       endpoint: str) -> None:
    url, llm = server
    reqs = _requests(llm)
    target = serve.ServeTarget(url, serve.first_model(url), endpoint)
    assert target.model == "smol"
    out = serve.run(target, reqs, request_rate=math.inf, tokenizer=llm.tokenizer,
                    progress=False)
    assert out["completed"] == 4 and out["failed"] == 0
    assert out["total_output_tokens"] == sum(r.output_len for r in reqs)
    assert out["tokens_from"] == ["usage"]
    assert out["short_outputs"] == 0
    s = out["samples"]
    assert len(s["ttfts"]) == len(s["e2els"]) == 4 and len(s["tpots"]) == 4
    assert all(0 < t <= e for t, e in zip(s["ttfts"], s["e2els"], strict=True))
    assert 0 < len(s["itls"]) <= sum(r.output_len - 1 for r in reqs)
    for key in ("request_throughput", "output_throughput", "total_token_throughput",
                "mean_ttft_ms", "p99_e2el_ms", "median_tpot_ms", "p90_itl_ms"):
        assert out[key] > 0, key


def test_poisson_rate_and_concurrency_cap(server: tuple[str, LLMEngine]) -> None:
    url, llm = server
    reqs = _requests(llm, 6)
    target = serve.ServeTarget(url, "smol")
    out = serve.run(target, reqs, request_rate=20.0, max_concurrency=2, seed=1, progress=False)
    assert out["completed"] == 6 and out["max_concurrency"] == 2
    assert out["total_output_tokens"] == sum(r.output_len for r in reqs)


def test_failures_are_counted_not_raised(server: tuple[str, LLMEngine]) -> None:
    url, llm = server
    out = serve.run(serve.ServeTarget(url, "no-such-model"), _requests(llm, 2),
                    request_rate=math.inf, progress=False)
    assert out["completed"] == 0 and out["failed"] == 2
    assert "HTTP 404" in out["errors"][0]
    assert out["output_throughput"] == 0


def test_arrivals_are_seeded_gamma_with_the_right_mean() -> None:
    a = serve.arrival_offsets(2000, 10.0, seed=1)
    assert a[0] == 0 and np.all(np.diff(a) >= 0)
    assert np.diff(a).mean() == pytest.approx(0.1, rel=0.1)
    assert np.array_equal(a, serve.arrival_offsets(2000, 10.0, seed=1))
    bursty = np.diff(serve.arrival_offsets(2000, 10.0, burstiness=0.25, seed=1))
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.15)  # CV = 1/sqrt(0.25)
    assert not serve.arrival_offsets(5, math.inf).any()


def test_metrics_follow_vllm_definitions() -> None:
    ok = RequestResult(10, 5, success=True, output_tokens=5, ttft=0.1, latency=0.5,
                       itl=[0.1, 0.1, 0.1, 0.1])
    one = RequestResult(20, 1, success=True, output_tokens=1, ttft=0.2, latency=0.2)
    bad = RequestResult(30, 5, error="HTTP 500")
    m, samples = serve_metrics.calculate([ok, one, bad], duration=2.0)
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 6
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 3.0
    assert m["total_token_throughput"] == 18.0
    assert samples["tpots"] == [pytest.approx(0.1)]  # (0.5 - 0.1) / (5 - 1); one token: none
    assert m["mean_ttft_ms"] == pytest.approx(150.0)
    assert m["mean_e2el_ms"] == pytest.approx(350.0)
    assert m["p99_itl_ms"] == pytest.approx(100.0)


def test_launch_runs_a_server_and_writes_json_and_plot(default_model: Path,
                                                       tmp_path: Path) -> None:
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    assert main(["bench", "serve", "--launch", "--num-prompts", "3", "--input-len", "8",
                 "--output-len", "4:6", "--request-rate", "50,inf", "--max-model-len", "64",
                 "--max-num-seqs", "4", "--kv-cache-memory", "32M", "--no-progress",
                 "--json", str(out), "--plot", str(png)]) == 0
    result = json.loads(out.read_text())
    assert result["server"]["launched"] and result["server"]["startup_s"] > 0
    assert [r["request_rate"] for r in result["runs"]] == [50.0, math.inf]
    assert all(r["completed"] == 3 and r["failed"] == 0 for r in result["runs"])
    assert png.stat().st_size > 1000
