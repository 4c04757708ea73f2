"""The engine on its own thread, for asyncio callers: submit, stream outputs, abort.

    event loop (server)                          engine thread
    generate() --("add", future)--> inbox ------> LLMEngine.add_request (ValueError -> future)
    async for out in stream  <-- call_soon_threadsafe <-- step() outputs
    disconnect/cancel --("abort")--> inbox -----> LLMEngine.abort_request (KV freed at once)

The event loop never runs a model step; the engine thread never touches asyncio objects except
through ``call_soon_threadsafe``. Everything that reads engine state (stats) is also a command,
so nothing races with a step. If a step raises, the engine is dead: every stream ends with
:class:`EngineDeadError` and :attr:`AsyncEngine.dead` says why.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from vmkv.engine.front import EngineFront
from vmkv.engine.llm_engine import LLMEngine
from vmkv.engine.outputs import OutputAccumulator, RequestOutput
from vmkv.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("vmkv")


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an error; no request can be served."""


class EngineOverloadedError(RuntimeError):
    """Too many requests are already waiting; this one was not queued (retry later)."""


class _Inbox(Protocol):
    """Where a stream sends its abort: an engine thread's inbox or a replica's pipe."""

    dead: BaseException | None

    def _submit(self, kind: str, payload: Any) -> None: ...


def admit(engine: LLMEngine, request_id: str, prompt: str | list[int], params: SamplingParams,
          cache_salt: str | None, max_waiting: int | None) -> None:
    """Queue a request unless ``max_waiting`` sequences already wait (EngineOverloadedError);
    ValueError for a bad request. Nothing is queued when it raises."""
    waiting = len(engine.scheduler.waiting)
    if max_waiting is not None and waiting >= max_waiting:
        raise EngineOverloadedError(f"{waiting} requests are already waiting")
    engine.add_request(request_id, prompt, params, cache_salt=cache_salt)


class RequestStream:
    """The outputs of one submitted request, as an async iterator (of deltas, or of whole
    outputs: as the request's ``output_kind`` says).

    Outputs the reader has not taken yet are merged into one as they arrive (deltas are added
    up, a whole output replaces the one before): a reader that falls behind, or stops reading,
    costs one pending output, never a queue of them. ``abort()`` (also safe after the end)
    stops the request in the engine and frees its KV. Outputs arrive from another thread
    through :meth:`put`.
    """

    def __init__(self, engine: _Inbox, request_id: str, loop: asyncio.AbstractEventLoop,
                 params: SamplingParams) -> None:
        self.engine = engine
        self.request_id = request_id
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
            self.engine._submit("abort", (self.request_id, None))

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


class AsyncEngine:
    """Runs an :class:`LLMEngine` loop on a daemon thread; safe to use from one event loop."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.front = EngineFront.of(engine)
        self._inbox: queue.SimpleQueue[tuple[str, Any, concurrent.futures.Future | None]] = (
            queue.SimpleQueue())
        self._streams: dict[str, RequestStream] = {}
        self.dead: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="vmkv-engine", daemon=True)
        self._thread.start()

    # -- caller side (event loop) -------------------------------------------------------------
    async def add(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                  cache_salt: str | None = None, *, max_waiting: int | None = None
                  ) -> RequestStream:
        """Submit a request; returns once the engine accepted it.

        Raises ValueError (bad request, nothing queued), EngineOverloadedError (``max_waiting``
        sequences already wait to be scheduled; nothing queued) or EngineDeadError.
        """
        stream = RequestStream(self, request_id, asyncio.get_running_loop(), params)
        await self._call("add", (request_id, prompt, params, cache_salt, stream, max_waiting))
        return stream

    async def generate(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Submit and yield outputs (as ``params.output_kind`` says) until finished; leaving
        early aborts."""
        stream = await self.add(request_id, prompt, params)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    async def abort(self, request_id: str, reason: str | None = None) -> None:
        """Abort a request (no-op if it is unknown or already finished); its stream still gets
        the final output (``finish_reason="abort"``, ``stop_reason=reason``)."""
        await self._call("abort", (request_id, reason))

    async def abort_all(self, reason: str | None = None) -> int:
        """Abort every request, as :meth:`abort` does; returns how many there were."""
        return await self._call("abort_all", reason)

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps (consistent stats reads)."""
        return await self._call("call", fn)

    async def call_all(self, fn: Callable[[LLMEngine], Any]) -> list[Any]:
        """:meth:`call` as a one-replica list (the interface of
        :class:`~vmkv.engine.front.ServingEngine`)."""
        return [await self.call(fn)]

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._submit("stop", None)
        self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self.dead is None and self._thread.is_alive()

    def _submit(self, kind: str, payload: Any,
                future: concurrent.futures.Future | None = None) -> None:
        self._inbox.put((kind, payload, future))

    async def _call(self, kind: str, payload: Any) -> Any:
        if self.dead is not None:
            raise EngineDeadError(f"the engine loop died: {self.dead!r}")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(kind, payload, future)
        if self.dead is not None:  # it died meanwhile: its last drain may have missed this
            self._fail_future(future, EngineDeadError(f"the engine loop died: {self.dead!r}"))
        return await asyncio.wrap_future(future)

    # -- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_inbox(block=not self.engine.has_unfinished_requests())
                if self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        self._deliver(out)
                else:  # idle: a dead tensor-parallel rank must not wait for the next request
                    self.engine.check_health()
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the callers
            logger.exception("engine loop died")
            self.dead = exc
            self._fail_everything(exc)

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, payload: Any, future: concurrent.futures.Future | None) -> None:
        try:
            if kind == "add":
                request_id, prompt, params, cache_salt, stream, max_waiting = payload
                admit(self.engine, request_id, prompt, params, cache_salt, max_waiting)
                self._streams[request_id] = stream
                result = None
            elif kind == "abort":
                self._abort(*payload)
                result = None
            elif kind == "abort_all":
                ids = list(self.engine.requests)
                for request_id in ids:
                    self._abort(request_id, payload)
                result = len(ids)
            elif kind == "call":
                result = payload(self.engine)
            else:  # "stop"
                result = None
        except Exception as exc:  # bad input: the caller gets it, the loop goes on
            if future is None:
                logger.warning("%s %r failed: %s", kind, payload, exc)
                return
            future.set_exception(exc)
            return
        if future is not None:
            future.set_result(result)

    def _abort(self, request_id: str, reason: str | None) -> None:
        out = self.engine.abort_request(request_id, reason)
        if out is not None:
            self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        if out.finished:
            del self._streams[out.request_id]
        stream.put(out)

    def _fail_everything(self, exc: BaseException) -> None:
        error = EngineDeadError(f"the engine loop died: {exc!r}")
        for stream in self._streams.values():
            stream.put(error)
        self._streams.clear()
        while True:
            try:
                _, _, future = self._inbox.get_nowait()
            except queue.Empty:
                return
            if future is not None:
                self._fail_future(future, error)

    @staticmethod
    def _fail_future(future: concurrent.futures.Future, error: BaseException) -> None:
        # answered already when the engine thread and a caller raced to fail it
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            future.set_exception(error)
