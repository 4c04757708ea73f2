"""The engine on its own thread, for asyncio callers: submit, stream outputs, abort.

    event loop (server)                           engine thread: EngineLoop
    add() --Add + future--> inbox --------------> dispatcher: LLMEngine.add_request
                                                  (ValueError -> future)
    async for out in stream  <-- call_soon_threadsafe <-- step() outputs
    disconnect/cancel --Abort--> inbox ---------> LLMEngine.abort_request (KV freed at once)

The event loop never runs a model step; the engine thread never touches asyncio objects except
through ``call_soon_threadsafe``. Everything that reads engine state (stats) is also a command,
so nothing races with a step; the commands are typed (vmkv/commands.py) and run by the engine
loop a data-parallel replica runs too (vmkv/engine/engine_loop.py), here over a thread queue
(:class:`ThreadTransport`). If a step raises, the engine is dead: every stream ends with
:class:`EngineDeadError` and :attr:`AsyncEngine.dead` says why. Only the engine thread touches
the engine: :meth:`AsyncEngine.shutdown` asks it to close the engine as it ends, never closes
it under a running step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from vmkv.commands import Abort, AbortAll, Add, Call, Command, Stop
from vmkv.engine.dispatcher import Done
from vmkv.engine.engine_loop import EngineLoop
from vmkv.engine.errors import EngineDeadError, EngineOverloadedError
from vmkv.engine.front import EngineFront
from vmkv.engine.llm_engine import LLMEngine
from vmkv.engine.outputs import RequestOutput
from vmkv.engine.request_stream import RequestStream, settle
from vmkv.sampling_params import SamplingParams

__all__ = ["AsyncEngine", "EngineDeadError", "EngineOverloadedError", "RequestStream"]

logger = logging.getLogger("vmkv")

#: a command, the future its caller awaits (None: nobody) and, for an Add, its stream
Envelope = tuple[Command, concurrent.futures.Future | None, RequestStream | None]


class ThreadTransport:
    """The engine loop's side of an :class:`AsyncEngine`: commands from an inbox filled by the
    event loop, answers to futures, outputs to the registered streams (engine thread only,
    but :meth:`put` and :attr:`stopping`)."""

    def __init__(self) -> None:
        self.inbox: queue.SimpleQueue[Envelope] = queue.SimpleQueue()
        self.streams: dict[str, RequestStream] = {}
        self.stopping = False  # set by shutdown(): the loop ends after its step

    def put(self, command: Command, future: concurrent.futures.Future | None = None,
            stream: RequestStream | None = None) -> None:
        """(Any thread.) Queue ``command``; ``future`` gets its answer, ``stream`` is
        registered once its Add is admitted."""
        self.inbox.put((command, future, stream))

    def receive(self, timeout: float) -> tuple[Command, Done] | None:
        if self.stopping:
            return Stop(), _ignore
        try:
            item = self.inbox.get(timeout=timeout) if timeout else self.inbox.get_nowait()
        except queue.Empty:
            return None
        command, future, stream = item
        return command, self._answer(command, future, stream)

    def _answer(self, command: Command, future: concurrent.futures.Future | None,
                stream: RequestStream | None) -> Done:
        def done(ok: bool, value: Any) -> None:
            if ok and stream is not None:  # admitted, before any step: no output is missed
                self.streams[stream.request_id] = stream
            if future is None:
                if not ok:
                    logger.warning("%r failed: %s", command, value)
                return
            settle(future, ok, value)

        return done

    def send(self, outputs: list[RequestOutput]) -> None:
        streams = self.streams
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del streams[out.request_id]
            stream.put(out)

    def fail_everything(self, error: EngineDeadError) -> None:
        """End every stream and every queued caller with ``error`` (the loop died)."""
        for stream in self.streams.values():
            stream.put(error)
        self.streams.clear()
        while True:
            try:
                _, future, _ = self.inbox.get_nowait()
            except queue.Empty:
                return
            if future is not None:
                fail_future(future, error)


def fail_future(future: concurrent.futures.Future, error: BaseException) -> None:
    """Fail ``future`` unless it is answered already (the engine thread and a caller raced)."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        future.set_exception(error)


def _ignore(ok: bool, value: Any) -> None:
    """The answer to a command nobody waits for."""


class AsyncEngine:
    """Runs an :class:`LLMEngine` loop on a daemon thread; safe to use from one event loop."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.front = EngineFront.of(engine)
        self._transport = ThreadTransport()
        self._loop = EngineLoop(engine, self._transport)
        self.dead: BaseException | None = None
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
            self.submit(Abort(request_id))  # it may be queued by now: nobody would read it
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
        self._transport.stopping = True
        self.submit(Stop())
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("the engine thread is still in a step after %.0f s; it closes the "
                           "engine when the step ends", timeout)
        elif close_engine:
            self.engine.close()  # (a no-op when the thread closed it; it ended: no race)

    @property
    def is_alive(self) -> bool:
        return self.dead is None and self._thread.is_alive()

    def submit(self, command: Command) -> None:
        """Send ``command`` to the engine thread without waiting for its answer (a failure is
        logged): what a stream's ``abort()`` uses."""
        self._transport.put(command)

    async def _call(self, command: Command, stream: RequestStream | None = None) -> Any:
        if self.dead is not None:
            raise EngineDeadError(f"the engine loop died: {self.dead!r}")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._transport.put(command, future, stream)
        if self.dead is not None:  # it died meanwhile: its last drain may have missed this
            fail_future(future, EngineDeadError(f"the engine loop died: {self.dead!r}"))
        return await asyncio.wrap_future(future)

    # -- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop.run()
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the callers
            logger.exception("engine loop died")
            self.dead = exc
            self._transport.fail_everything(EngineDeadError(f"the engine loop died: {exc!r}"))
        finally:
            if self._close_engine:
                self.engine.close()
