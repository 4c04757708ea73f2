"""``/metrics``: Prometheus text with vLLM's metric names under a ``vmkv:`` prefix, plus the
virtual-memory ones (reserved, mapped, in use, map/unmap calls and latency).

Engine state is read on the engine thread (between steps) into a :class:`Snapshot`, one per
replica (vmkv/engine/snapshot.py); request latencies are observed here, in the server, from what
it streams.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from vmkv.engine.front import ServingEngine
from vmkv.engine.snapshot import Snapshot, combine, take_snapshot

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)


class _EngineCollector(Collector):
    """The engine numbers of the last snapshots: labelled ``model_name`` for one engine; for
    N replicas also ``replica``: ``"0"`` .. ``"N-1"``, and ``"all"`` for their combination."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        snapshots, name = self.metrics.snapshots, self.metrics.model_name
        labels = ["model_name"]
        rows: list[tuple[list[str], Snapshot]] = [([name], snapshots[0])]
        if len(snapshots) > 1:
            labels.append("replica")
            rows = [([name, str(i)], s) for i, s in enumerate(snapshots)]
            rows.append(([name, "all"], combine(snapshots)))
        total = rows[-1][1]

        def family(kind: type, metric: str, doc: str, value: Callable[[Snapshot], float]
                   ) -> Any:
            f = kind(f"vmkv:{metric}", doc, labels=labels)
            for values, s in rows:
                f.add_metric(values, value(s))
            return f

        def gauge(metric: str, doc: str, value: Callable[[Snapshot], float]) -> Any:
            return family(GaugeMetricFamily, metric, doc, value)

        def counter(metric: str, doc: str, value: Callable[[Snapshot], float]) -> Any:
            return family(CounterMetricFamily, metric, doc, value)

        def usage(key: str) -> Callable[[Snapshot], float]:
            return lambda s: s.usage.get(key, 0)

        yield gauge("num_requests_running", "Sequences running in the engine.",
                    lambda s: s.running)
        yield gauge("num_requests_waiting", "Sequences waiting to be scheduled.",
                    lambda s: s.waiting)
        yield gauge("kv_cache_usage_perc", "KV capacity in use by live requests (0-1).",
                    lambda s: s.usage.get("fraction", 0.0))
        yield counter("prompt_tokens", "Prompt tokens of accepted requests.",
                      lambda s: s.prompt_tokens)
        yield counter("generation_tokens", "Generated tokens.", lambda s: s.generation_tokens)
        success = CounterMetricFamily("vmkv:request_success", "Finished requests by reason.",
                                      labels=[*labels, "finished_reason"])
        for values, s in rows:
            for reason, count in sorted(s.finished.items()):
                success.add_metric([*values, reason], count)
        yield success
        yield counter("num_preemptions", "Preemptions.", lambda s: s.preemptions)
        yield counter("num_recomputed_tokens", "Tokens recomputed after preemption.",
                      lambda s: s.recomputed_tokens)
        yield counter("num_swapped_tokens", "Tokens swapped out to host memory.",
                      lambda s: s.swapped_tokens)
        if total.prefix_enabled:
            yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                          lambda s: s.prefix_queries)
            yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                          lambda s: s.prefix_hits)
            yield gauge("kv_prefix_cached_bytes", "KV bytes held only by the prefix cache "
                        "(evictable, not in use).", usage("bytes_cached"))
        # KV memory (vmkv): what live requests need, what is held, created, reserved
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
        for op in total.memory_ops:
            def op_stat(key: str, scale: float = 1.0, op: str = op
                        ) -> Callable[[Snapshot], float]:
                return lambda s: s.memory_ops.get(op, {}).get(key, 0) * scale

            yield counter(f"kv_{op}_calls", f"Page {op} calls.", op_stat("calls"))
            yield counter(f"kv_{op}_pages", f"Pages passed to {op}.", op_stat("pages"))
            yield counter(f"kv_{op}_seconds", f"Time in page {op} calls.",
                          op_stat("total_ms", 1e-3))
            yield gauge(f"kv_{op}_latency_p50_seconds", f"Median recent {op} call latency.",
                        op_stat("p50_us", 1e-6))
            yield gauge(f"kv_{op}_latency_p99_seconds", f"p99 recent {op} call latency.",
                        op_stat("p99_us", 1e-6))


#: how long /metrics waits for fresh engine numbers (read between two steps) before serving
#: the previous ones; an idle engine answers in about a millisecond
SNAPSHOT_WAIT = 1.0


class Metrics:
    """The registry: engine collector, request latency histograms, refusals and timeouts."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.snapshots: list[Snapshot] = [Snapshot()]  # one per replica
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

    async def refresh(self, engine: ServingEngine, wait: float = SNAPSHOT_WAIT) -> None:
        """Read the engine's numbers (on its thread, between steps) into ``snapshots``, waiting
        at most ``wait`` seconds: during a longer step /metrics answers with the previous
        numbers (``metrics_snapshot_age_seconds`` says how old), and however often it is
        scraped at most one read is queued on the engine thread."""
        if not engine.is_alive:
            return
        if self._reading is None or self._reading.done():
            self._reading = asyncio.ensure_future(engine.call_all(take_snapshot))
            self._reading.add_done_callback(self._store)
        await asyncio.wait({self._reading}, timeout=wait)

    def _store(self, reading: asyncio.Future) -> None:
        if not reading.cancelled() and reading.exception() is None:
            self.snapshots = reading.result()

    def render(self) -> bytes:
        return generate_latest(self.registry)
