"""The engine on its own thread, for asyncio callers: submit, stream outputs, abort.

    event loop (server)                           engine thread
    add() --Add + future--> inbox --------------> CommandRunner: LLMEngine.add_request
                                                  (ValueError -> future)
    async for out in stream  <-- call_soon_threadsafe <-- step() outputs
    disconnect/cancel --Abort--> inbox ---------> LLMEngine.abort_request (KV freed at once)

The event loop never runs a model step; the engine thread never touches asyncio objects except
through ``call_soon_threadsafe``. Everything that reads engine state (stats) is also a command,
so nothing races with a step; the commands are typed (vmkv/commands.py) and run by the
dispatcher a data-parallel replica uses too (vmkv/engine/commands.py). If a step raises, the
engine is dead: every stream ends with :class:`EngineDeadError` and :attr:`AsyncEngine.dead`
says why. Only the engine thread touches the engine: :meth:`AsyncEngine.shutdown` asks it to
close the engine as it ends, never closes it under a running step.
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

from vmkv.commands import Abort, AbortAll, Add, Call, Command, Stop
from vmkv.engine.commands import CommandRunner
from vmkv.engine.errors import EngineDeadError, EngineOverloadedError
from vmkv.engine.front import EngineFront
from vmkv.engine.llm_engine import LLMEngine
from vmkv.engine.outputs import OutputAccumulator, RequestOutput
from vmkv.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["AsyncEngine", "EngineDeadError", "EngineOverloadedError", "RequestStream"]

logger = logging.getLogger("vmkv")

#: seconds an idle engine thread waits for a command before checking the ranks' health
IDLE_POLL = 0.5
#: seconds it waits while a request's grammar compiles on the helper thread
COMPILE_POLL = 0.01


class _Inbox(Protocol):
    """Where a stream sends its abort: an engine thread's inbox or a replica's pipe."""

    dead: BaseException | None

    def _submit(self, command: Command) -> None: ...


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
            self.engine._submit(Abort(self.request_id))

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
        # each command with the future its caller awaits and, for an Add, the stream to register
        self._inbox: queue.SimpleQueue[
            tuple[Command, concurrent.futures.Future | None, RequestStream | None]] = (
            queue.SimpleQueue())
        self._streams: dict[str, RequestStream] = {}
        self._commands = CommandRunner(engine, self._deliver)
        self.dead: BaseException | None = None
        self._stopping = False
        self._close_engine = False
        self._thread = threading.Thread(target=self._run, name="vmkv-engine", daemon=True)
        self._thread.start()

    # -- caller side (event loop) -------------------------------------------------------------
    async def add(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                  cache_salt: str | None = None, *, max_waiting: int | None = None
                  ) -> RequestStream:
        """Submit a request; returns once the engine accepted it.

        Raises ValueError (bad request, nothing queued), EngineOverloadedError (``max_waiting``
        sequences already wait to be scheduled; nothing queued) or EngineDeadError. A caller
        cancelled meanwhile aborts the request, if it was queued.
        """
        stream = RequestStream(self, request_id, asyncio.get_running_loop(), params)
        add = Add(request_id, prompt, params, cache_salt, max_waiting)
        try:
            await self._call(add, stream)
        except asyncio.CancelledError:
            self._submit(Abort(request_id))  # it may be queued by now: nobody would read it
            raise
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
        await self._call(Abort(request_id, reason))

    async def abort_all(self, reason: str | None = None) -> int:
        """Abort every request, as :meth:`abort` does; returns how many there were."""
        return await self._call(AbortAll(reason))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps (consistent stats reads)."""
        return await self._call(Call(fn))

    async def call_all(self, fn: Callable[[LLMEngine], Any]) -> list[Any]:
        """:meth:`call` as a one-replica list (the interface of
        :class:`~vmkv.engine.front.ServingEngine`)."""
        return [await self.call(fn)]

    def shutdown(self, timeout: float = 10.0, *, close_engine: bool = False) -> None:
        """Stop the engine thread (waiting up to ``timeout`` seconds for its step to end);
        ``close_engine``: the thread then closes the engine (KV memory, ranks) itself, so
        closing never races with a step that is still running."""
        self._close_engine = self._close_engine or close_engine
        self._stopping = True
        self._submit(Stop())
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("the engine thread is still in a step after %.0f s; it closes the "
                           "engine when the step ends", timeout)
        elif close_engine:
            self.engine.close()  # (a no-op when the thread closed it; it ended: no race)

    @property
    def is_alive(self) -> bool:
        return self.dead is None and self._thread.is_alive()

    def _submit(self, command: Command, future: concurrent.futures.Future | None = None,
                stream: RequestStream | None = None) -> None:
        self._inbox.put((command, future, stream))

    async def _call(self, command: Command, stream: RequestStream | None = None) -> Any:
        if self.dead is not None:
            raise EngineDeadError(f"the engine loop died: {self.dead!r}")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(command, future, stream)
        if self.dead is not None:  # it died meanwhile: its last drain may have missed this
            self._fail_future(future, EngineDeadError(f"the engine loop died: {self.dead!r}"))
        return await asyncio.wrap_future(future)

    # -- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                busy = self.engine.has_unfinished_requests()
                self._drain_inbox(timeout=0 if busy else
                                  COMPILE_POLL if self._commands.waiting else IDLE_POLL)
                self._commands.poll()
                if self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        self._deliver(out)
                else:  # idle: a dead tensor-parallel rank must not wait for the next request
                    self.engine.check_health()
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the callers
            logger.exception("engine loop died")
            self.dead = exc
            self._fail_everything(exc)
        finally:
            self._commands.close()
            if self._close_engine:
                self.engine.close()

    def _drain_inbox(self, timeout: float) -> None:
        try:
            item = self._inbox.get(timeout=timeout) if timeout else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, command: Command, future: concurrent.futures.Future | None,
                stream: RequestStream | None) -> None:
        def done(ok: bool, value: Any) -> None:
            if ok and stream is not None:  # admitted, before any step: no output is missed
                self._streams[stream.request_id] = stream
            if future is None:
                if not ok:
                    logger.warning("%r failed: %s", command, value)
                return
            # a caller cancelled meanwhile cancelled its future too: nobody waits for this
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(value)

        self._commands.run(command, done)

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
                _, future, _ = self._inbox.get_nowait()
            except queue.Empty:
                return
            if future is not None:
                self._fail_future(future, error)

    @staticmethod
    def _fail_future(future: concurrent.futures.Future, error: BaseException) -> None:
        # answered already when the engine thread and a caller raced to fail it
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            future.set_exception(error)
