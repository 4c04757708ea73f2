"""The parent's end of one data-parallel replica (vmkv/engine/replica.py is the child's).

    event loop                writer thread                 reader thread
    add/abort/call --> outbox --> conn.send ==pipe==> replica ==pipe==> conn.recv
                                                                          |  outputs -> streams
    await future <----------------------------------------------------- replies -> futures

The event loop never blocks on the pipe: a writer thread sends (a busy replica reads only
between steps), a reader thread receives and hands outputs to the streams with
``call_soon_threadsafe``. The reader sees the replica's death at once (the pipe closes when the
process dies, whatever killed it): every stream and pending call then fails with
:class:`EngineDeadError`, and ``on_death`` tells the owner.

``load`` is this replica's unfinished sequences as the router counts them (``n`` per request,
from ``add`` until its final output), the number least-loaded routing compares.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import queue
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from vmkv.commands import Abort, AbortAll, Add, Command, Stop
from vmkv.engine.errors import EngineDeadError
from vmkv.engine.outputs import RequestOutput
from vmkv.engine.request_stream import RequestStream, settle
from vmkv.sampling_params import SamplingParams

logger = logging.getLogger("vmkv")


class ReplicaClient:
    """One replica process, its pipe, and the streams of the requests it runs."""

    def __init__(self, index: int, process: BaseProcess, conn: Connection,
                 on_death: Callable[[ReplicaClient, EngineDeadError], None]) -> None:
        self.index = index
        self.process = process
        self.conn = conn
        self.on_death = on_death
        self.dead: EngineDeadError | None = None
        self.load = 0
        self._streams: dict[str, tuple[RequestStream, int]] = {}
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._outbox: queue.SimpleQueue[tuple[int | None, Command] | None] = queue.SimpleQueue()
        self._stopping = False
        self._threads: list[threading.Thread] = []

    # -- start-up -----------------------------------------------------------------------------
    def wait_ready(self, timeout: float) -> None:
        """Wait for the replica's engine to be built; RuntimeError (or the replica's own
        ValueError) if it failed or exited, TimeoutError after ``timeout`` seconds."""
        waited = 0.0
        while not self.conn.poll(0.2):
            waited += 0.2
            if not self.process.is_alive():
                raise RuntimeError(f"data-parallel replica {self.index} exited with "
                                   f"{_exit_status(self.process)} while starting")
            if waited >= timeout:
                raise TimeoutError(f"data-parallel replica {self.index} was not ready after "
                                   f"{timeout:.0f} s")
        try:
            kind, _, payload = self.conn.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"data-parallel replica {self.index} exited while starting "
                               f"({_exit_status(self.process)})") from None
        if kind == "failed":
            raise payload
        for target, name in ((self._write, "writer"), (self._read, "reader")):
            thread = threading.Thread(target=target, daemon=True,
                                      name=f"vmkv-replica{self.index}-{name}")
            thread.start()
            self._threads.append(thread)

    # -- caller side (event loop) -------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return self.dead is None and self.process.is_alive()

    def owns(self, request_id: str) -> bool:
        return request_id in self._streams

    async def add(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                  cache_salt: str | None, max_waiting: int | None) -> RequestStream:
        """Submit a request to this replica (errors as :meth:`AsyncEngine.add`)."""
        stream = RequestStream(self, request_id, asyncio.get_running_loop(), params,
                               self.index)
        with self._lock:  # registered first: its outputs may come right after the reply
            self._streams[request_id] = (stream, params.n)
            self.load += params.n
        try:
            await self.call(Add(request_id, prompt, params, cache_salt, max_waiting))
        except asyncio.CancelledError:
            self._forget(request_id)
            self.submit(Abort(request_id))  # it may have been queued meanwhile
            raise
        except BaseException:
            self._forget(request_id)
            raise
        return stream

    async def call(self, command: Command) -> Any:
        """Send a command and await the replica's reply (its exception is raised here)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self.dead is not None:
                raise self.dead
            call_id = next(self._ids)
            self._pending[call_id] = future
        self._outbox.put((call_id, command))
        return await asyncio.wrap_future(future)

    def submit(self, command: Command) -> None:
        """Send a command without waiting for a reply (what a stream's ``abort()`` uses)."""
        self._outbox.put((None, command))

    def fail(self, error: EngineDeadError) -> None:
        """End every stream and pending call with ``error`` and abort this replica's requests
        (another replica died: the whole engine fails)."""
        self._fail_all(error)
        if self.process.is_alive():
            self.submit(AbortAll(error.args[0] if error.args else None))

    # -- shutdown -----------------------------------------------------------------------------
    def request_stop(self) -> None:
        """Ask the replica to close its engine and exit (see :meth:`join`)."""
        self._stopping = True
        self._outbox.put((None, Stop()))
        self._outbox.put(None)  # the writer ends after it

    def join(self, timeout: float) -> None:
        """Wait for the process (SIGTERM, then SIGKILL if it does not end), then the threads;
        every stream still open ends with EngineDeadError. A replica that never became ready
        cannot read ``stop``: it is terminated at once."""
        self.process.join(timeout if self._threads else 0)
        for kill in (self.process.terminate, self.process.kill):
            if self.process.exitcode is None:
                kill()
                self.process.join(5)
        for thread in self._threads:
            thread.join(5)  # the reader ends at the pipe's EOF, now the process is gone
        self.conn.close()
        self._fail_all(EngineDeadError(f"data-parallel replica {self.index} was shut down"))

    # -- threads ------------------------------------------------------------------------------
    def _write(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self.conn.send(message)
            except (EOFError, OSError):  # the replica is gone: the reader reports it
                return
            except Exception as exc:  # noqa: BLE001 - the payload does not pickle
                self._resolve(message[0], False, ValueError(
                    f"cannot send {type(message[1]).__name__} to replica {self.index}: {exc}"))

    def _read(self) -> None:
        reason: str | None = None
        try:
            while True:
                kind, call_id, payload = self.conn.recv()
                if kind == "outputs":
                    self._deliver(payload)
                elif kind == "reply":
                    self._resolve(call_id, *payload)
                elif kind == "died":
                    reason = payload
        except (EOFError, OSError):
            pass
        if self._stopping:
            return
        self.process.join(1)
        error = EngineDeadError(
            f"data-parallel replica {self.index} (pid {self.process.pid}) died: "
            f"{_exit_status(self.process)}" + (f"\n{reason}" if reason else ""))
        logger.error("%s", error)
        self._fail_all(error)
        self.on_death(self, error)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            with self._lock:
                entry = self._streams.get(out.request_id)
                if entry is not None and out.finished:
                    del self._streams[out.request_id]
                    self.load -= entry[1]
            if entry is not None:
                entry[0].put(out)

    def _resolve(self, call_id: int | None, ok: bool, value: Any) -> None:
        with self._lock:
            future = self._pending.pop(call_id, None) if call_id is not None else None
        if future is not None:
            settle(future, ok, value)

    def _forget(self, request_id: str) -> None:
        with self._lock:
            entry = self._streams.pop(request_id, None)
            if entry is not None:
                self.load -= entry[1]

    def _fail_all(self, error: EngineDeadError) -> None:
        with self._lock:
            if self.dead is None:
                self.dead = error
            streams, self._streams = self._streams, {}
            pending, self._pending = self._pending, {}
            self.load = 0
        for stream, _ in streams.values():
            stream.put(error)
        for future in pending.values():
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                future.set_exception(error)


def _exit_status(process: BaseProcess) -> str:
    code = process.exitcode
    if code is None:
        return "still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"
