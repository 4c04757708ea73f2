"""``/metrics``: Prometheus text with vLLM's metric names under a ``vmkv:`` prefix, plus the
virtual-memory ones (reserved, mapped, in use, map/unmap calls and latency).

Engine state is read on the engine thread (between steps) into a :class:`Snapshot`; request
latencies are observed here, in the server, from what it streams.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from vmkv.engine.async_engine import AsyncEngine
from vmkv.engine.llm_engine import LLMEngine

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)


@dataclass
class Snapshot:
    """Engine numbers taken on the engine thread."""

    running: int = 0
    waiting: int = 0
    usage: dict[str, float] = field(default_factory=dict)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    preemptions: int = 0
    recomputed_tokens: int = 0
    swapped_tokens: int = 0
    memory_ops: dict[str, dict[str, float]] = field(default_factory=dict)
    prefix_queries: int = 0
    prefix_hits: int = 0
    prefix_enabled: bool = False
    taken_at: float = field(default_factory=time.monotonic)


def take_snapshot(engine: LLMEngine) -> Snapshot:
    """Read the engine's counters (call on the engine thread)."""
    kv = engine.kv
    stats = engine.scheduler.stats
    return Snapshot(
        running=len(engine.scheduler.running),
        waiting=len(engine.scheduler.waiting),
        usage=kv.usage.as_dict(),
        prompt_tokens=engine.counters.prompt_tokens,
        generation_tokens=engine.counters.generation_tokens,
        finished=dict(engine.counters.finished),
        preemptions=stats.num_preemptions,
        recomputed_tokens=stats.num_recomputed_tokens,
        swapped_tokens=stats.num_swapped_out_tokens,
        memory_ops=kv.memory_stats(),
        prefix_queries=kv.prefix.queries if kv.prefix is not None else 0,
        prefix_hits=kv.prefix.hits if kv.prefix is not None else 0,
        prefix_enabled=kv.prefix is not None,
    )


class _EngineCollector(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        s, name = self.metrics.snapshot, self.metrics.model_name

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"vmkv:{metric}", doc, labels=["model_name"])
            g.add_metric([name], value)
            return g

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"vmkv:{metric}", doc, labels=["model_name"])
            c.add_metric([name], value)
            return c

        u = s.usage
        yield gauge("num_requests_running", "Sequences running in the engine.", s.running)
        yield gauge("num_requests_waiting", "Sequences waiting to be scheduled.", s.waiting)
        yield gauge("kv_cache_usage_perc", "KV capacity in use by live requests (0-1).",
                    u.get("fraction", 0.0))
        yield counter("prompt_tokens", "Prompt tokens of accepted requests.", s.prompt_tokens)
        yield counter("generation_tokens", "Generated tokens.", s.generation_tokens)
        success = CounterMetricFamily("vmkv:request_success", "Finished requests by reason.",
                                      labels=["model_name", "finished_reason"])
        for reason, count in sorted(s.finished.items()):
            success.add_metric([name, reason], count)
        yield success
        yield counter("num_preemptions", "Preemptions.", s.preemptions)
        yield counter("num_recomputed_tokens", "Tokens recomputed after preemption.",
                      s.recomputed_tokens)
        yield counter("num_swapped_tokens", "Tokens swapped out to host memory.",
                      s.swapped_tokens)
        if s.prefix_enabled:
            yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                          s.prefix_queries)
            yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                          s.prefix_hits)
            yield gauge("kv_prefix_cached_bytes", "KV bytes held only by the prefix cache "
                        "(evictable, not in use).", u.get("bytes_cached", 0))
        # KV memory (vmkv): what live requests need, what is held, created, reserved
        yield gauge("kv_capacity_bytes", "Physical KV budget.", u.get("capacity_bytes", 0))
        yield gauge("kv_physical_bytes_in_use", "Physical KV bytes live requests need.",
                    u.get("bytes_in_use", 0))
        yield gauge("kv_physical_bytes_held", "Physical KV bytes held, incl. kept for reuse.",
                    u.get("bytes_held", 0))
        yield gauge("kv_physical_bytes_created", "Physical KV bytes created (not returned).",
                    u.get("bytes_created", 0))
        yield gauge("kv_token_bytes", "Bytes of live tokens' K/V.", u.get("token_bytes", 0))
        yield gauge("kv_virtual_reserved_bytes", "Virtual address space reserved for KV.",
                    u.get("virt_reserved_bytes", 0))
        yield gauge("kv_pool_allocated_bytes", "KV pool memory the OS/driver has committed "
                    "(host: the memfd's blocks; not RSS).", u.get("bytes_allocated", 0))
        yield gauge("metrics_snapshot_age_seconds", "Age of the engine numbers above (a long "
                    "step delays their refresh).", time.monotonic() - s.taken_at)
        for op, stats in s.memory_ops.items():
            yield counter(f"kv_{op}_calls", f"Page {op} calls.", stats["calls"])
            yield counter(f"kv_{op}_pages", f"Pages passed to {op}.", stats["pages"])
            yield counter(f"kv_{op}_seconds", f"Time in page {op} calls.",
                          stats["total_ms"] / 1e3)
            yield gauge(f"kv_{op}_latency_p50_seconds", f"Median recent {op} call latency.",
                        stats["p50_us"] / 1e6)
            yield gauge(f"kv_{op}_latency_p99_seconds", f"p99 recent {op} call latency.",
                        stats["p99_us"] / 1e6)


#: how long /metrics waits for fresh engine numbers (read between two steps) before serving
#: the previous ones; an idle engine answers in about a millisecond
SNAPSHOT_WAIT = 1.0


class Metrics:
    """The registry: engine collector, request latency histograms, refusals and timeouts."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.snapshot = Snapshot()
        self._reading: asyncio.Future | None = None
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(self))

        def histogram(metric: str, doc: str) -> Histogram:
            return Histogram(f"vmkv:{metric}", doc, ["model_name"], registry=self.registry,
                             buckets=_LATENCY_BUCKETS).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens.")
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency end to end.")
        self.rejected = Counter("vmkv:requests_rejected", "Requests refused with 503 by "
                                "reason: queue_full (--max-waiting-requests), busy (worker "
                                "pools full), draining (shutting down).",
                                ["model_name", "reason"], registry=self.registry)
        self.timeouts = Counter("vmkv:request_timeouts", "Requests aborted by "
                                "--request-timeout.", ["model_name"], registry=self.registry)

    async def refresh(self, engine: AsyncEngine, wait: float = SNAPSHOT_WAIT) -> None:
        """Read the engine's numbers (on its thread, between steps) into ``snapshot``, waiting
        at most ``wait`` seconds: during a longer step /metrics answers with the previous
        numbers (``metrics_snapshot_age_seconds`` says how old), and however often it is
        scraped at most one read is queued on the engine thread."""
        if not engine.is_alive:
            return
        if self._reading is None or self._reading.done():
            self._reading = asyncio.ensure_future(engine.call(take_snapshot))
            self._reading.add_done_callback(self._store)
        await asyncio.wait({self._reading}, timeout=wait)

    def _store(self, reading: asyncio.Future) -> None:
        if not reading.cancelled() and reading.exception() is None:
            self.snapshot = reading.result()

    def render(self) -> bytes:
        return generate_latest(self.registry)
