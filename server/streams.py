"""The stream side of a generation request: the deltas of its engine requests merged as they
come, under the request's deadline (``--request-timeout``), with the latency metrics observed;
a client that disconnects or stops reading aborts them (their KV is freed at once)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from fastapi import Request

from vmkv.engine.async_engine import EngineDeadError
from vmkv.engine.front import ServingEngine, Stream
from vmkv.engine.outputs import OutputAccumulator, RequestOutput
from vmkv.server.errors import APIError
from vmkv.server.metrics import Metrics


class StreamMerger:
    """Merges the engine streams of one HTTP request at a time: ``merged`` yields their deltas
    (tagged with the stream's index), ``collect`` adds them up into final outputs. Either way
    every stream is aborted when the consumer stops early, and each delta is observed by the
    request histograms (server/metrics.py)."""

    def __init__(self, engine: ServingEngine, metrics: Metrics,
                 request_timeout: float | None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.request_timeout = request_timeout

    async def merged(self, streams: list[Stream], started: float
                     ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Deltas of several streams as they come, observed by the request metrics; an output
        whose KV memory was refused raises APIError 503.

        Bounded: a consumer that stops (a client that stops reading) leaves at most one delta
        per stream here; the streams merge what comes meanwhile (vmkv/engine/async_engine.py).
        """
        queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))
        observer = self.metrics.observer(streams, started)

        async def pump(i: int, stream: Stream) -> None:
            try:
                async for out in stream:
                    await queue.put((i, out))
            except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
                await queue.put((i, exc))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        timer = self._deadline(streams, started)
        try:
            remaining = len(streams)
            while remaining:
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.error is not None:  # its KV memory was refused: the request failed
                    raise APIError(503, item.error)
                observer.observe(i, item)
                if item.finished:
                    remaining -= 1
                yield i, item
        finally:
            if timer is not None:
                timer.cancel()
            for t in tasks:
                t.cancel()
            for s in streams:
                s.abort()

    async def collect(self, raw: Request, streams: list[Stream], started: float
                      ) -> list[RequestOutput]:
        """Final outputs (the deltas added up); a client that disconnects meanwhile aborts
        the requests (APIError 499)."""
        sums = [OutputAccumulator() for _ in streams]
        final: list[RequestOutput | None] = [None] * len(streams)

        async def run() -> None:
            async for i, out in self.merged(streams, started):
                sums[i].add(out)
                if out.finished:
                    final[i] = sums[i].take()

        task = asyncio.create_task(run())
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await raw.is_disconnected():
                task.cancel()
                for s in streams:
                    s.abort()
                raise APIError(499, "client disconnected")
        task.result()
        return [o for o in final if o is not None]

    def _deadline(self, streams: list[Stream], started: float) -> asyncio.TimerHandle | None:
        """Abort the streams ``request_timeout`` seconds after ``started`` (they still get
        their final output: finish_reason "abort", stop_reason "timeout")."""
        timeout = self.request_timeout
        if timeout is None:
            return None

        async def expire() -> None:
            self.metrics.timeouts.labels(self.metrics.model_name).inc()
            with contextlib.suppress(EngineDeadError):  # then the streams end with it anyway
                for s in streams:
                    await self.engine.abort(s.request_id, "timeout")

        loop = asyncio.get_running_loop()
        return loop.call_later(max(0.0, started + timeout - time.monotonic()),
                               lambda: asyncio.ensure_future(expire()))
