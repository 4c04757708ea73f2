"""``vmkv bench serve``: load an OpenAI-compatible server the way vLLM's ``bench serve`` does.

Requests leave at Poisson times (``request_rate`` per second; ``inf`` sends all at once) or
gamma times with shape ``burstiness`` (1 is Poisson; lower is burstier), at most
``max_concurrency`` in flight. Each streams (``stream_options.include_usage``); completions send
the prompt as token ids (vLLM accepts them too) with ``max_tokens=output_len``, greedy and
``ignore_eos`` in the body; chat sends the prompt decoded to text. Output tokens come from the
final ``usage`` chunk when the server sends one, else from the local tokenizer on the streamed
text, else from the number of chunks. Metrics: :mod:`vmkv.bench.serve_metrics`.

NOTE: one deliberate difference from vLLM's client: a chat chunk that only announces the role
(``{"role": "assistant", "content": ""}``, sent before any token) is not output. vLLM counts it
as the first token, which makes chat TTFT measure request acceptance instead.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vmkv.bench import serve_metrics
from vmkv.bench.common import progress_bar
from vmkv.bench.serve_metrics import RequestResult
from vmkv.bench.workloads import BenchRequest

TIMEOUT_S = 6 * 3600


@dataclass(frozen=True)
class ServeTarget:
    """Where and how to send: base URL (``http://host:port``), model name, endpoint."""

    base_url: str
    model: str
    endpoint: str = "completions"
    api_key: str | None = None

    def __post_init__(self) -> None:
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint must be 'completions' or 'chat', got {self.endpoint!r}")

    @property
    def url(self) -> str:
        path = "chat/completions" if self.endpoint == "chat" else "completions"
        return f"{self.base_url.rstrip('/')}/v1/{path}"


def arrival_offsets(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
                    ) -> np.ndarray:
    """Send times (s after the start) of ``n`` requests: gamma gaps of mean ``1 / rate`` and
    shape ``burstiness`` (exponential, i.e. Poisson arrivals, at 1); all zero at ``inf``."""
    if request_rate <= 0:
        raise ValueError(f"request_rate must be positive or inf, got {request_rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if math.isinf(request_rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).gamma(burstiness, 1 / (request_rate * burstiness), n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])  # the first request leaves at once


def request_body(target: ServeTarget, req: BenchRequest, decode: Callable[[list[int]], str] | None
                 ) -> dict[str, Any]:
    body: dict[str, Any] = {"model": target.model, "temperature": 0.0, "ignore_eos": True,
                            "stream": True, "stream_options": {"include_usage": True}}
    if target.endpoint == "chat":
        if decode is None:
            raise ValueError("the chat endpoint needs a tokenizer to turn prompts into text")
        body["messages"] = [{"role": "user", "content": decode(req.prompt_token_ids)}]
        body["max_completion_tokens"] = req.output_len
    else:
        body["prompt"] = req.prompt_token_ids
        body["max_tokens"] = req.output_len
    return body


def _chunk_text(choice: dict[str, Any], endpoint: str) -> str | None:
    if endpoint == "chat":
        delta = choice.get("delta") or {}
        if delta.get("role") and not delta.get("content"):
            return None  # the role announcement, sent before any token
        return delta.get("content")
    return choice.get("text")


async def send_one(client: Any, target: ServeTarget, req: BenchRequest,
                   decode: Callable[[list[int]], str] | None,
                   count: Callable[[str], int] | None) -> RequestResult:
    """Stream one request and time it (vLLM's ``async_request_openai_*`` semantics)."""
    result = RequestResult(len(req.prompt_token_ids), req.output_len)
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    text, chunks, usage_tokens = [], 0, None
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", target.url, json=request_body(target, req, decode),
                                 headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {body[:200]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                payload = json.loads(data)
                now = time.perf_counter()
                piece = None
                if payload.get("choices"):
                    piece = _chunk_text(payload["choices"][0], target.endpoint)
                if piece is not None:
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    chunks += 1
                    last = now
                    text.append(piece)
                if payload.get("usage"):
                    usage_tokens = payload["usage"].get("completion_tokens")
    except Exception as exc:  # noqa: BLE001 - any transport or parse error fails this request
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    if chunks == 0:
        result.error = "no output chunk received"
        return result
    result.success, result.latency = True, last - start
    if usage_tokens is not None:
        result.output_tokens, result.tokens_from = int(usage_tokens), "usage"
    elif count is not None:
        result.output_tokens, result.tokens_from = count("".join(text)), "tokenizer"
    else:
        result.output_tokens, result.tokens_from = chunks, "chunks"
    return result


async def _run(target: ServeTarget, requests: Sequence[BenchRequest], offsets: np.ndarray,
               max_concurrency: int | None, decode: Callable[[list[int]], str] | None,
               count: Callable[[str], int] | None, progress: bool
               ) -> tuple[list[RequestResult], float]:
    import httpx

    limit = max_concurrency or len(requests)
    semaphore = asyncio.Semaphore(limit)
    bar = progress_bar(progress, "serve", total=len(requests))
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(timeout=httpx.Timeout(TIMEOUT_S), limits=limits) as client:
        start = time.perf_counter()

        async def one(req: BenchRequest, offset: float) -> RequestResult:
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with semaphore:  # sent (and timed) once a concurrency slot is free
                result = await send_one(client, target, req, decode, count)
            bar.update(1)
            return result

        results = await asyncio.gather(*(one(r, float(o)) for r, o in
                                         zip(requests, offsets, strict=True)))
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


def run(target: ServeTarget, requests: Sequence[BenchRequest], *, request_rate: float,
        burstiness: float = 1.0, max_concurrency: int | None = None, seed: int = 0,
        tokenizer: Any = None, progress: bool = True) -> dict[str, Any]:
    """One load test; returns metrics, options and raw latency samples (seconds)."""
    if max_concurrency is not None and max_concurrency <= 0:
        raise ValueError(f"max_concurrency must be positive, got {max_concurrency}")
    offsets = arrival_offsets(len(requests), request_rate, burstiness, seed)
    decode = count = None
    if tokenizer is not None:
        decode = lambda ids: tokenizer.decode(ids)  # noqa: E731
        count = lambda text: len(tokenizer(text, add_special_tokens=False).input_ids)  # noqa: E731
    results, duration = asyncio.run(_run(target, requests, offsets, max_concurrency, decode,
                                         count, progress))
    metrics, samples = serve_metrics.calculate(results, duration)
    return {"request_rate": request_rate, "burstiness": burstiness,
            "max_concurrency": max_concurrency, "endpoint": target.endpoint,
            "tokens_from": sorted({r.tokens_from for r in results if r.success}),
            **metrics, "samples": samples}


def table_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [{
        "rate": r["request_rate"], "conc": r["max_concurrency"] or "-", "ok": r["completed"],
        "fail": r["failed"], "req/s": r["request_throughput"], "out tok/s": r["output_throughput"],
        "total tok/s": r["total_token_throughput"], "TTFT ms": r["mean_ttft_ms"],
        "TTFT p99": r["p99_ttft_ms"], "TPOT ms": r["mean_tpot_ms"], "ITL ms": r["mean_itl_ms"],
        "ITL p99": r["p99_itl_ms"], "E2E ms": r["mean_e2el_ms"], "E2E p99": r["p99_e2el_ms"],
    } for r in result["runs"]]


COLUMNS = ("rate", "conc", "ok", "fail", "req/s", "out tok/s", "total tok/s", "TTFT ms",
           "TTFT p99", "TPOT ms", "ITL ms", "ITL p99", "E2E ms", "E2E p99")


def first_model(base_url: str, api_key: str | None = None) -> str:
    """The first model id the server lists at ``/v1/models``."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    resp = httpx.get(f"{base_url.rstrip('/')}/v1/models", headers=headers, timeout=30)
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise ValueError(f"{base_url} lists no model; pass --model")
    return data[0]["id"]
