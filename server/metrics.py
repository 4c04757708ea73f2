"""``/metrics``: Prometheus text. vLLM's names and label sets come first, so a deployment's
dashboards, autoscalers (KEDA/HPA on ``vllm:num_requests_waiting``) and routers (reading
``vllm:kv_cache_usage_perc``) work unchanged; vmkv's own are beside them under ``vmkv:``.

    vllm:*   engine gauges and counters, ``iteration_tokens_total``  server/engine_metrics.py
             (read on the engine thread between steps: one Snapshot per engine)
             request histograms (TTFT, inter-token latency, end to end, the queue, prefill,
             decode and inference phases, prompt and generation lengths, n, max_tokens) and
             ``cache_config_info``                                    here
    http_*   prometheus-fastapi-instrumentator's, as vLLM exposes them (``instrument``)
    vmkv:*   KV memory, pages, the mapper (engine_metrics.py); refusals and timeouts (here)

Every engine metric is labelled ``model_name`` (the first served name) and ``engine`` (the
data-parallel replica: ``"0"`` with one engine), as vLLM's are. Request histograms are
observed from what the server streams (:class:`RequestObserver`) with the engine's own
timestamps for the phases (vLLM's intervals: queue = scheduled - arrived; prefill = first
token - scheduled; decode = finished - first token; inference = finished - scheduled).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from vmkv.engine.snapshot import Snapshot, take_snapshot
from vmkv.server.engine_metrics import LABELS, EngineCollector

if TYPE_CHECKING:
    from fastapi import FastAPI

    from vmkv.config import EngineConfig
    from vmkv.engine.front import ServingEngine, Stream
    from vmkv.engine.outputs import RequestOutput

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                     5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)
#: routes the HTTP metrics leave out (vLLM's list): probes and scrapes, not API traffic
UNCOUNTED_ROUTES = ("/metrics", "/health", "/ping", "/version")

#: how long /metrics waits for fresh engine numbers (read between two steps) before serving
#: the previous ones; an idle engine answers in about a millisecond
SNAPSHOT_WAIT = 1.0


def one_two_five(most: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``most`` (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > most:
                return buckets
            buckets.append(m * scale)
        scale *= 10


class Metrics:
    """The registry: the engine collector, vLLM's request histograms, the HTTP metrics,
    ``cache_config_info``, and vmkv's refusals and timeouts."""

    def __init__(self, model_name: str, engine_config: EngineConfig | None = None,
                 max_model_len: int = 1 << 20, num_engines: int = 1) -> None:
        self.model_name = model_name
        self.snapshots: list[Snapshot] = [Snapshot() for _ in range(num_engines)]
        self._reading: asyncio.Future | None = None
        self.registry = registry = CollectorRegistry()
        registry.register(EngineCollector(lambda: (self.model_name, self.snapshots)))

        def histogram(metric: str, doc: str, buckets: Any) -> Histogram:
            return Histogram(f"vllm:{metric}", doc, LABELS, registry=registry, buckets=buckets)

        lengths = one_two_five(max_model_len)
        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first "
                              "token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token "
                             "latency in seconds.", TOKEN_GAP_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Histogram of time per output "
                              "token in seconds (vLLM's older name of the inter-token "
                              "latency, which older dashboards read).", TOKEN_GAP_BUCKETS)
        self.request_tpot = histogram(
            "request_time_per_output_token_seconds", "Histogram of time_per_output_token_"
            "seconds per request: (end to end - time to first token) / (output tokens - 1), "
            "0 with one token at most.", TOKEN_GAP_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of e2e request "
                             "latency in seconds.", REQUEST_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Histogram of time spent in "
                               "WAITING phase for request.", REQUEST_BUCKETS)
        self.inference = histogram("request_inference_time_seconds", "Histogram of time "
                                   "spent in RUNNING phase for request.", REQUEST_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds", "Histogram of time spent in "
                                 "PREFILL phase for request.", REQUEST_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "Histogram of time spent in "
                                "DECODE phase for request.", REQUEST_BUCKETS)
        self.prompt_tokens = histogram("request_prompt_tokens", "Number of prefill tokens "
                                       "processed.", lengths)
        self.generation_tokens = histogram("request_generation_tokens", "Number of generation "
                                           "tokens processed.", lengths)
        self.max_generation_tokens = histogram(
            "request_max_num_generation_tokens", "Histogram of maximum number of requested "
            "generation tokens (the most one sample of the request generated).", lengths)
        self.params_n = histogram("request_params_n", "Histogram of the n request parameter.",
                                  N_BUCKETS)
        self.params_max_tokens = histogram("request_params_max_tokens", "Histogram of the "
                                           "max_tokens request parameter.", lengths)
        self.rejected = Counter("vmkv:requests_rejected", "Requests refused with 503 by "
                                "reason: queue_full (--max-waiting-requests), busy (worker "
                                "pools full), draining (shutting down).",
                                ["model_name", "reason"], registry=registry)
        self.timeouts = Counter("vmkv:request_timeouts", "Requests aborted by "
                                "--request-timeout.", ["model_name"], registry=registry)
        if engine_config is not None:
            self._cache_config_info(engine_config, num_engines)

    def _cache_config_info(self, config: EngineConfig, num_engines: int) -> None:
        """vLLM's ``cache_config_info``: a gauge at 1 whose labels are the KV settings."""
        cache = config.cache
        info = {"block_size": str(cache.block_size), "cache_dtype": config.kv_cache_dtype_name,
                "enable_prefix_caching": str(cache.enable_prefix_caching),
                "prefix_caching_hash_algo": cache.prefix_cache_hash,
                "kv_mode": cache.kv_mode, "kv_layout": str(cache.kv_layout),
                "page_size": str(cache.page_size), "kv_cache_memory": str(cache.kv_cache_memory)}
        gauge = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                      [*info, *LABELS], registry=self.registry)
        for engine in range(num_engines):
            gauge.labels(*info.values(), self.model_name, str(engine)).set(1)

    def instrument(self, app: FastAPI) -> None:
        """The HTTP metrics vLLM exposes (prometheus-fastapi-instrumentator: requests by
        handler, method and status class, their sizes and durations), in this registry."""
        from prometheus_fastapi_instrumentator import Instrumentator

        Instrumentator(excluded_handlers=list(UNCOUNTED_ROUTES),
                       registry=self.registry).instrument(app)

    def observer(self, streams: list[Stream], started: float) -> RequestObserver:
        """What observes the request histograms of one HTTP request's engine streams."""
        return RequestObserver(self, streams, started)

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


@dataclass
class _Seen:
    """What one engine stream has delivered so far."""

    first_at: float | None = None  # when its first token came
    last_at: float | None = None  # when its latest tokens came
    tokens: int = 0
    prompt_tokens: int = 0
    per_sample: dict[int, int] = field(default_factory=dict)  # tokens per sample index


class RequestObserver:
    """vLLM's request histograms for the engine streams of one HTTP request, fed every delta
    (:meth:`observe`): time to first token and end to end from when the server received the
    request (``started``), inter-token gaps as tokens arrive, and at each stream's end its
    phases (the engine's timestamps), lengths and parameters."""

    def __init__(self, metrics: Metrics, streams: list[Stream], started: float) -> None:
        self.metrics, self.started = metrics, started
        self.labels = [(metrics.model_name, str(getattr(s, "engine_index", 0)))
                       for s in streams]
        self.params = [getattr(s, "params", None) for s in streams]
        self.seen = [_Seen() for _ in streams]

    def observe(self, i: int, out: RequestOutput) -> None:
        """Stream ``i``'s delta ``out``."""
        m, seen, labels = self.metrics, self.seen[i], self.labels[i]
        now = time.monotonic()
        if out.prompt_token_ids is not None:
            seen.prompt_tokens = len(out.prompt_token_ids)
        new = 0
        for c in out.outputs:
            new += len(c.token_ids)
            seen.per_sample[c.index] = seen.per_sample.get(c.index, 0) + len(c.token_ids)
        if new and seen.first_at is None:
            seen.first_at = now
            m.ttft.labels(*labels).observe(now - self.started)
        elif new:
            gap = (now - seen.last_at) / new
            for _ in range(new):
                m.itl.labels(*labels).observe(gap)
                m.tpot.labels(*labels).observe(gap)
        if new:
            seen.tokens += new
            seen.last_at = now
        if out.finished:
            self._finished(i, out, now)

    def _finished(self, i: int, out: RequestOutput, now: float) -> None:
        m, seen, labels = self.metrics, self.seen[i], self.labels[i]
        e2e = now - self.started
        m.e2e.labels(*labels).observe(e2e)
        t = out.metrics
        if t.first_scheduled_time is not None:
            m.queue.labels(*labels).observe(max(0.0, t.first_scheduled_time - t.arrival_time))
            if t.finish_time is not None:
                m.inference.labels(*labels).observe(t.finish_time - t.first_scheduled_time)
            if t.first_token_time is not None:
                m.prefill.labels(*labels).observe(t.first_token_time - t.first_scheduled_time)
        if t.first_token_time is not None and t.finish_time is not None:
            m.decode.labels(*labels).observe(t.finish_time - t.first_token_time)
        most = max(seen.per_sample.values(), default=0)
        ttft = (seen.first_at or now) - self.started
        m.request_tpot.labels(*labels).observe((e2e - ttft) / (most - 1) if most > 1 else 0.0)
        m.prompt_tokens.labels(*labels).observe(seen.prompt_tokens)
        m.generation_tokens.labels(*labels).observe(seen.tokens)
        m.max_generation_tokens.labels(*labels).observe(most)
        params = self.params[i]
        if params is not None:
            m.params_n.labels(*labels).observe(params.n)
            if params.max_tokens:
                m.params_max_tokens.labels(*labels).observe(params.max_tokens)
