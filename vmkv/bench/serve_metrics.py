"""Client-side serving metrics, defined as vLLM's ``bench serve`` computes them (chat: the role-only
first chunk carries no output and does not count; see serve.py).

Per request (all at the client, from the moment the request is sent):

    TTFT   time to the first streamed chunk that carries output
    ITL    gaps between consecutive output chunks (pooled over all requests)
    E2EL   time to the last output chunk
    TPOT   (E2EL - TTFT) / (output_tokens - 1), for requests with more than one output token

Over the run (``duration`` = first request sent to last response finished): request
throughput = completed / duration, output throughput = output tokens / duration, total token
throughput = (prompt + output tokens) / duration; failed requests count 0 output tokens. Each
latency has mean, median, std and percentiles (ms); empty lists give 0, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    """What the client saw of one request (times in seconds, ``perf_counter`` based)."""

    prompt_len: int
    expected_output_len: int
    success: bool = False
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    tokens_from: str = ""  # "usage", "tokenizer" or "chunks"
    error: str = ""


def _stats(name: str, values: Sequence[float], percentiles: Sequence[int]) -> dict[str, float]:
    arr = np.asarray(values, dtype=float) * 1e3 if len(values) else np.zeros(1)
    out = {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
           f"std_{name}_ms": float(arr.std())}
    out.update({f"p{p}_{name}_ms": float(np.percentile(arr, p)) for p in percentiles})
    return out


def calculate(results: Sequence[RequestResult], duration: float,
              percentiles: Sequence[int] = PERCENTILES) -> tuple[dict[str, Any], dict[str, list]]:
    """(metrics, raw samples) of one run; samples are in seconds, for CDFs."""
    ok = [r for r in results if r.success]
    output = sum(r.output_tokens for r in ok)
    prompt = sum(r.prompt_len for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    samples = {"ttfts": [r.ttft for r in ok], "tpots": tpots,
               "itls": [x for r in ok for x in r.itl], "e2els": [r.latency for r in ok]}
    metrics: dict[str, Any] = {
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "short_outputs": sum(r.output_tokens < r.expected_output_len for r in ok),
        "request_throughput": len(ok) / duration,
        "output_throughput": output / duration,
        "total_token_throughput": (prompt + output) / duration,
    }
    for key, name in (("ttfts", "ttft"), ("tpots", "tpot"), ("itls", "itl"), ("e2els", "e2el")):
        metrics.update(_stats(name, samples[key], percentiles))
    errors = sorted({r.error for r in results if not r.success})
    if errors:
        metrics["errors"] = errors[:5]
    return metrics, samples
