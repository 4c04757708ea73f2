"""The outputs of one submitted request, as the asyncio side reads them (the streams of
:class:`~vmkv.engine.async_engine.AsyncEngine` and of data-parallel replicas alike)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import AsyncIterator
from typing import Any, Protocol

from vmkv.commands import Abort, Command
from vmkv.engine.outputs import OutputAccumulator, RequestOutput
from vmkv.sampling_params import RequestOutputKind, SamplingParams


def settle(future: concurrent.futures.Future, ok: bool, value: Any) -> None:
    """Give a command's caller its answer (``value``, or the exception ``value`` when not
    ``ok``); a caller that gave up meanwhile cancelled its future: nobody waits, nothing to do."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)


class CommandSink(Protocol):
    """Where a stream sends its abort: an engine thread's inbox or a replica's pipe."""

    dead: BaseException | None

    def submit(self, command: Command) -> None:
        """Send ``command`` to the engine loop without waiting for its answer."""
        ...


class RequestStream:
    """The outputs of one submitted request, as an async iterator (of deltas, or of whole
    outputs: as the request's ``output_kind`` says).

    Outputs the reader has not taken yet are merged into one as they arrive (deltas are added
    up, a whole output replaces the one before): a reader that falls behind, or stops reading,
    costs one pending output, never a queue of them. ``abort()`` (also safe after the end)
    stops the request in the engine and frees its KV. Outputs arrive from another thread
    through :meth:`put`.
    """

    def __init__(self, engine: CommandSink, request_id: str, loop: asyncio.AbstractEventLoop,
                 params: SamplingParams, engine_index: int = 0) -> None:
        self.engine = engine
        self.request_id = request_id
        self.params = params
        self.engine_index = engine_index  # which data-parallel replica runs it (metrics)
        self.loop = loop
        self.finished = False
        self._deltas = params.output_kind is RequestOutputKind.DELTA
        self._unread = OutputAccumulator()  # deltas not taken yet, added up
        self._latest: RequestOutput | None = None  # a whole output not taken yet
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            if not self._unread and self._latest is None and self._error is None:
                await self._ready.wait()
                self._ready.clear()
            if self._unread or self._latest is not None:
                item = self._unread.take() if self._unread else self._latest
                self._latest = None
                self.finished = item.finished
                yield item
            elif self._error is not None:
                self.finished = True
                raise self._error

    def abort(self) -> None:
        """Abort the request unless it already finished (no-op then)."""
        if not self.finished and self.engine.dead is None:
            self.finished = True
            self.engine.submit(Abort(self.request_id))

    def put(self, item: RequestOutput | BaseException) -> None:
        """Deliver an output or the error that ends the stream (from any thread)."""
        with contextlib.suppress(RuntimeError):  # its event loop is closed: nobody listens
            self.loop.call_soon_threadsafe(self._receive, item)

    def _receive(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self._error = item
        elif self._deltas:
            self._unread.add(item)
        else:
            self._latest = item
        self._ready.set()
