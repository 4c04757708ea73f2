"""Graceful shutdown on a deadline (``--shutdown-timeout``).

    serving --SIGTERM/SIGINT--> draining --all done, or the deadline--> aborting --> exit 0
                                   |                                       |
    new work: 503 + Retry-After    running requests go on           the rest are aborted: each
    /health: 503 "draining"        (streams, queued ones too)       stream gets a last chunk with
                                                                    finish_reason "abort"
                                                                    (stop_reason "shutdown")
    a second SIGTERM/SIGINT at any point: the process exits at once (status 128 + signal)

:class:`Lifecycle` is the state the app consults (``/health``, the admission middleware, and
``submit`` once aborting); :class:`GracefulServer` is uvicorn's server with signal handling that
drains first instead of waiting for every connection without a limit, and exits 0 afterwards
(uvicorn re-raises the signal after its own shutdown, which would end the process by it).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from types import FrameType
from typing import Any

import uvicorn

from vmkv.engine.front import ServingEngine
from vmkv.server.auth import OPEN_PATHS
from vmkv.server.errors import RETRY_AFTER, error_response
from vmkv.server.metrics import Metrics

logger = logging.getLogger("vmkv.server")

#: seconds aborted requests get to send their last event before the server closes
ABORT_GRACE = 5.0


class Lifecycle:
    """Serving, draining or aborting; counts the work requests in flight."""

    def __init__(self, engine: ServingEngine, metrics: Metrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self.draining = False
        self.aborting = False
        self.inflight = 0

    async def drain(self, timeout: float) -> int:
        """Stop admitting work, let what runs finish for ``timeout`` seconds, then abort the
        rest and give their responses :data:`ABORT_GRACE` seconds to end; returns how many
        engine requests were aborted."""
        self.draining = True
        logger.info("draining: %d requests in flight, %.0f s to finish", self.inflight, timeout)
        if await self._idle_within(timeout):
            return 0
        self.aborting = True
        aborted = await self.engine.abort_all("shutdown") if self.engine.is_alive else 0
        logger.warning("shutdown deadline reached: aborted %d requests", aborted)
        await self._idle_within(ABORT_GRACE)
        return aborted

    async def _idle_within(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.inflight


class Admission:
    """ASGI middleware: counts work requests in flight; while draining refuses new ones with
    503 + Retry-After (open paths such as /health and /metrics always pass)."""

    def __init__(self, app: Any, lifecycle: Lifecycle) -> None:
        self.app, self.lifecycle = app, lifecycle

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        life = self.lifecycle
        if life.draining:
            life.metrics.rejected.labels(life.metrics.model_name, "draining").inc()
            response = error_response(503, "the server is shutting down; retry on another "
                                      "replica", headers=RETRY_AFTER)
            return await response(scope, receive, send)
        life.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            life.inflight -= 1


class GracefulServer(uvicorn.Server):
    """uvicorn's server; the first SIGTERM/SIGINT drains (:meth:`Lifecycle.drain`) before the
    usual shutdown, a second one exits the process at once."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, timeout: float) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self.timeout = timeout
        self.drain_requested = False
        self._drain: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain_requested:
            logger.warning("second signal %d: exiting now", sig)
            os._exit(128 + sig)
        self.drain_requested = True  # not recorded for re-raising: the process exits 0

    async def on_tick(self, counter: int) -> bool:
        if self.drain_requested and self._drain is None:
            self._drain = asyncio.create_task(self._drain_then_exit())
        return await super().on_tick(counter)

    async def _drain_then_exit(self) -> None:
        try:
            await self.lifecycle.drain(self.timeout)
        finally:
            self.should_exit = True
