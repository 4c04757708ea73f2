"""The engine's numbers on ``/metrics``: one :class:`~vmkv.engine.snapshot.Snapshot` per engine
(read on its thread between steps), rendered under vLLM's names and label sets (``vllm:*``,
labelled ``model_name`` and ``engine``: ``"0"`` .. ``"N-1"``, one row per data-parallel replica
and nothing else, so ``sum`` over ``engine`` gives the server's totals as it does for vLLM), and
vmkv's own beside them (``vmkv:*``: KV memory, pages, the mapper)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from itertools import accumulate
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector

from vmkv.engine.llm_engine import ITERATION_TOKEN_BUCKETS
from vmkv.engine.snapshot import Snapshot

LABELS = ["model_name", "engine"]  # vLLM's label set for every engine metric
FINISH_REASONS = ("stop", "length", "abort", "error")  # vLLM's FinishReason values


class EngineCollector(Collector):
    """The engine numbers of the last snapshots: ``latest()`` gives the model name and one
    snapshot per engine."""

    def __init__(self, latest: Callable[[], tuple[str, list[Snapshot]]]) -> None:
        self.latest = latest

    def collect(self) -> Iterator[Any]:
        name, snapshots = self.latest()
        rows = [([name, str(i)], s) for i, s in enumerate(snapshots)]
        yield from _vllm_families(rows)
        yield from _vmkv_families(rows)


def _family(kind: type, metric: str, doc: str, rows: list[tuple[list[str], Snapshot]],
            value: Callable[[Snapshot], float]) -> Any:
    family = kind(metric, doc, labels=LABELS)
    for labels, s in rows:
        family.add_metric(labels, value(s))
    return family


def _vllm_families(rows: list[tuple[list[str], Snapshot]]) -> Iterator[Any]:
    """vLLM's engine metrics (vllm/v1/metrics/loggers.py), with its documentation strings'
    meaning; per-request histograms are the server's (server/metrics.py)."""

    def gauge(metric: str, doc: str, value: Callable[[Snapshot], float]) -> Any:
        return _family(GaugeMetricFamily, f"vllm:{metric}", doc, rows, value)

    def counter(metric: str, doc: str, value: Callable[[Snapshot], float]) -> Any:
        return _family(CounterMetricFamily, f"vllm:{metric}", doc, rows, value)

    yield gauge("num_requests_running", "Number of requests in model execution batches.",
                lambda s: s.running)
    yield gauge("num_requests_waiting", "Number of requests waiting to be processed "
                "(preempted ones included).", lambda s: s.waiting)
    yield gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage (the KV "
                "capacity live requests need).", lambda s: s.usage.get("fraction", 0.0))
    yield counter("prefix_cache_queries", "Prefix cache queries, in terms of number of "
                  "queried tokens.", lambda s: s.prefix_queries)
    yield counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                  "tokens.", lambda s: s.prefix_hits)
    yield counter("num_preemptions", "Cumulative number of preemption from the engine.",
                  lambda s: s.preemptions)
    yield counter("prompt_tokens", "Number of prefill tokens processed (prompt tokens of "
                  "accepted requests).", lambda s: s.prompt_tokens)
    yield counter("generation_tokens", "Number of generation tokens processed.",
                  lambda s: s.generation_tokens)
    success = CounterMetricFamily("vllm:request_success", "Count of successfully processed "
                                  "requests.", labels=[*LABELS, "finished_reason"])
    for labels, s in rows:
        for reason in sorted({*FINISH_REASONS, *s.finished}):
            success.add_metric([*labels, reason], s.finished.get(reason, 0))
    yield success
    steps = HistogramMetricFamily("vllm:iteration_tokens_total", "Histogram of number of "
                                  "tokens per engine_step.", labels=LABELS)
    bounds = [*map(str, map(float, ITERATION_TOKEN_BUCKETS)), "+Inf"]
    for labels, s in rows:
        counts = s.step_tokens or [0] * len(bounds)
        steps.add_metric(labels, list(zip(bounds, accumulate(counts), strict=True)),
                         s.step_tokens_sum)
    yield steps
    if any(s.spec_decode is not None for _, s in rows):
        yield from _spec_decode_families(rows)


def _spec_decode_families(rows: list[tuple[list[str], Snapshot]]) -> Iterator[Any]:
    """vLLM's speculative decoding counters (``--speculative-config``)."""
    for name, doc in (("num_drafts", "Number of spec decoding drafts."),
                      ("num_draft_tokens", "Number of draft tokens."),
                      ("num_accepted_tokens", "Number of accepted tokens.")):
        yield _family(CounterMetricFamily, f"vllm:spec_decode_{name}", doc, rows,
                      lambda s, key=f"spec_decode_{name}": (s.spec_decode or {}).get(key, 0))
    per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                  "Accepted tokens per draft position.",
                                  labels=[*LABELS, "position"])
    for labels, s in rows:
        for pos, n in enumerate((s.spec_decode or {}).get(
                "spec_decode_num_accepted_tokens_per_pos", [])):
            per_pos.add_metric([*labels, str(pos)], n)
    yield per_pos


def _vmkv_families(rows: list[tuple[list[str], Snapshot]]) -> Iterator[Any]:
    """vmkv's additions: recompute and swap, KV memory (what live requests need, what is held,
    created, reserved), the pool's committed memory, per page operation counts and latency."""

    def gauge(metric: str, doc: str, value: Callable[[Snapshot], float]) -> Any:
        return _family(GaugeMetricFamily, f"vmkv:{metric}", doc, rows, value)

    def counter(metric: str, doc: str, value: Callable[[Snapshot], float]) -> Any:
        return _family(CounterMetricFamily, f"vmkv:{metric}", doc, rows, value)

    def usage(key: str) -> Callable[[Snapshot], float]:
        return lambda s: s.usage.get(key, 0)

    yield counter("num_recomputed_tokens", "Tokens recomputed after preemption.",
                  lambda s: s.recomputed_tokens)
    yield counter("num_swapped_tokens", "Tokens swapped out to host memory.",
                  lambda s: s.swapped_tokens)
    if any(s.prefix_enabled for _, s in rows):
        yield gauge("kv_prefix_cached_bytes", "KV bytes held only by the prefix cache "
                    "(evictable, not in use).", usage("bytes_cached"))
    yield gauge("kv_capacity_bytes", "Physical KV budget.", usage("capacity_bytes"))
    yield gauge("kv_physical_bytes_in_use", "Physical KV bytes live requests need.",
                usage("bytes_in_use"))
    yield gauge("kv_physical_bytes_held", "Physical KV bytes held, incl. kept for reuse.",
                usage("bytes_held"))
    yield gauge("kv_physical_bytes_created", "Physical KV bytes created (not returned).",
                usage("bytes_created"))
    yield gauge("kv_token_bytes", "Bytes of live tokens' K/V.", usage("token_bytes"))
    yield gauge("kv_virtual_reserved_bytes", "Virtual address space reserved for KV.",
                usage("virt_reserved_bytes"))
    yield gauge("kv_pool_allocated_bytes", "KV pool memory the OS/driver has committed "
                "(host: the memfd's blocks; not RSS).", usage("bytes_allocated"))
    now = time.monotonic()
    yield gauge("metrics_snapshot_age_seconds", "Age of the engine numbers above (a long "
                "step delays their refresh).", lambda s: now - s.taken_at)
    ops = sorted({op for _, s in rows for op in s.memory_ops})
    for op in ops:
        def op_stat(key: str, scale: float = 1.0, op: str = op) -> Callable[[Snapshot], float]:
            return lambda s: s.memory_ops.get(op, {}).get(key, 0) * scale

        yield counter(f"kv_{op}_calls", f"Page {op} calls.", op_stat("calls"))
        yield counter(f"kv_{op}_pages", f"Pages passed to {op}.", op_stat("pages"))
        yield counter(f"kv_{op}_seconds", f"Time in page {op} calls.",
                      op_stat("total_ms", 1e-3))
        yield gauge(f"kv_{op}_latency_p50_seconds", f"Median recent {op} call latency.",
                    op_stat("p50_us", 1e-6))
        yield gauge(f"kv_{op}_latency_p99_seconds", f"p99 recent {op} call latency.",
                    op_stat("p99_us", 1e-6))
