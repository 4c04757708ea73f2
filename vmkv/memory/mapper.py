"""Background page mapping: map the next steps' pages while the device computes this one.

    engine thread: | schedule+allocate | launch step N | submit(units) | sample (GPU busy) | ...
    mapper thread:                                     |-- map pages for steps N+1.. --|
    engine thread:                      next KV call -> wait()  (the step's stall, measured)

Rules (vAttention's background thread, made safe for Python):

* **One thread at a time on the KV manager.** Work runs only between :meth:`submit` and the
  engine's next :meth:`wait`; the KV manager's hook calls :meth:`wait` at the top of every
  public method, so the engine can never observe a half-done mapping.
* **Map only, never unmap.** Unmapping needs a device synchronize (a queued kernel may still
  read the page) and stays on the engine thread. A unit that unmaps is an error: the mapper
  checks the backend's unmap counter around every unit.
* **Paused during CUDA-graph capture** (:meth:`paused`): in global capture mode a VMM call from
  *any* thread invalidates the capture. Pausing drains queued work, then drops new work.
* **Context**: the thread makes the backend's device context current before its first call.
* **No spinning**: the thread and :meth:`wait` sleep on one condition variable.

Work is a list of *units* (callables); the thread runs them in order. A unit's exception stops
the rest of that work and is re-raised (as :class:`VmmError`) by the next :meth:`wait`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from vmkv.memory.base import MemoryBackend
from vmkv.memory.errors import VmmError

Unit = Callable[[], object]
_SAMPLES = 4096


@dataclass
class MapperStats:
    """What the mapper did and what it cost the engine.

    ``stall`` is time the engine spent in :meth:`BackgroundMapper.wait` while work was still
    queued or running (vAttention's per-step "sync time"); waits that found the mapper idle
    count in ``waits`` but add no stall.
    """

    jobs: int = 0
    units: int = 0
    units_dropped: int = 0  # submitted while paused
    busy_ns: int = 0  # time the thread spent running units
    waits: int = 0
    stalled_waits: int = 0
    stall_ns: int = 0
    max_stall_ns: int = 0
    recent_stall_ns: deque[int] = field(default_factory=lambda: deque(maxlen=_SAMPLES))

    def as_dict(self) -> dict[str, float]:
        recent = np.fromiter(self.recent_stall_ns, dtype=np.int64)
        p = (lambda q: float(np.percentile(recent, q)) / 1e3) if len(recent) else (lambda q: 0.0)
        return {
            "jobs": self.jobs, "units": self.units, "units_dropped": self.units_dropped,
            "busy_ms": self.busy_ns / 1e6, "waits": self.waits,
            "stalled_waits": self.stalled_waits, "stall_ms": self.stall_ns / 1e6,
            "max_stall_us": self.max_stall_ns / 1e3, "stall_p50_us": p(50),
            "stall_p99_us": p(99),
        }


class BackgroundMapper:
    """A daemon thread that runs mapping units for one :class:`MemoryBackend`.

    Args:
        backend: the backend whose pages the units map (its unmap counter is watched).
        thread_init: run first on the thread (default: ``backend.bind_thread``, which makes
            the CUDA context current there).
        name: the thread's name.
    """

    def __init__(self, backend: MemoryBackend, *, thread_init: Callable[[], None] | None = None,
                 name: str = "vmkv-mapper") -> None:
        self.backend = backend
        self.stats = MapperStats()
        self._thread_init = thread_init if thread_init is not None else backend.bind_thread
        self._cond = threading.Condition()
        self._queue: deque[Unit] = deque()
        self._running = False
        self._paused = 0
        self._closed = False
        self._error: BaseException | None = None
        self._init_error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # -- engine side --------------------------------------------------------------------------
    def submit(self, units: Iterable[Unit]) -> int:
        """Queue ``units`` (dropped while paused); returns how many were queued."""
        work = list(units)
        with self._cond:
            if self._closed:
                why = f": its thread failed to start ({self._init_error!r})" if (
                    self._init_error is not None) else ""
                raise VmmError(f"background mapper is closed{why}")
            if self._paused:
                self.stats.units_dropped += len(work)
                return 0
            if work:
                self._queue.extend(work)
                self.stats.jobs += 1
                self._cond.notify_all()
        return len(work)

    @property
    def idle(self) -> bool:
        with self._cond:
            return not self._queue and not self._running

    def wait(self) -> float:
        """Block until all queued work is done; return the seconds spent blocked (0 if idle).

        Raises VmmError (carrying the unit's error) if a unit failed since the last wait.
        """
        start = time.perf_counter_ns()
        with self._cond:
            busy = bool(self._queue or self._running)
            while self._queue or self._running:
                self._cond.wait()
            error, self._error = self._error, None
        stalled = time.perf_counter_ns() - start if busy else 0
        s = self.stats
        s.waits += 1
        if busy:
            s.stalled_waits += 1
            s.stall_ns += stalled
            s.max_stall_ns = max(s.max_stall_ns, stalled)
            s.recent_stall_ns.append(stalled)
        if error is not None:
            raise VmmError(f"background mapper failed: {error!r}") from error
        return stalled / 1e9

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Drain queued work, then drop new work until the block exits (graph capture)."""
        self.wait()
        with self._cond:
            self._paused += 1
        try:
            yield
        finally:
            with self._cond:
                self._paused -= 1

    def close(self) -> None:
        """Drop queued work, stop the thread (after its current unit) and join it."""
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join()

    # -- mapper thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._thread_init()
        except BaseException as exc:  # every later wait() reports it
            with self._cond:
                self._error = self._init_error = exc
                self._closed = True
                self._cond.notify_all()
            return
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                unit = self._queue.popleft()
                self._running = True
            start = time.perf_counter_ns()
            unmaps = self.backend.stats.ops["unmap"].calls
            error: BaseException | None = None
            try:
                unit()
                if self.backend.stats.ops["unmap"].calls != unmaps:
                    raise RuntimeError("a mapper unit unmapped pages; unmapping belongs to the "
                                       "engine thread after a device synchronize")
            except BaseException as exc:
                error = exc
            with self._cond:
                self._running = False
                self.stats.units += 1
                self.stats.busy_ns += time.perf_counter_ns() - start
                if error is not None:
                    self._error = self._error or error
                    self._queue.clear()  # the rest of this work may depend on the failed unit
                self._cond.notify_all()
