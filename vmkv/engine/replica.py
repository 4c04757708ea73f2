"""One data-parallel replica: an :class:`LLMEngine` in its own process, driven over a
``multiprocessing`` Connection (the child side; the parent's is vmkv/engine/replica_client.py).

Messages are ``(kind, call_id, payload)`` tuples, pickled by the Connection:

    parent -> replica                                   replica -> parent
    ("add", id, (request_id, prompt, params,     ->     ("reply", id, (True, None)) or
                 cache_salt, max_waiting))              ("reply", id, (False, ValueError...))
    ("abort", None, (request_id, reason))        ->     its final output with the next outputs
    ("abort_all", id, reason)                    ->     final outputs, ("reply", id, (True, n))
    ("call", id, fn)                             ->     ("reply", id, (True, fn(engine)))
    ("stop", None, None)                         ->     the engine closes, the process exits 0
                                                        ("outputs", None, [RequestOutput, ...])
                                                        after every step that changed requests

At start the replica sends ``("ready", None, pid)``, or ``("failed", None, exception)`` and
exits. A step that raises sends ``("died", None, traceback)`` and exits 1: the parent fails the
replica's streams. The replica dies with its parent (``PR_SET_PDEATHSIG``: SIGKILL when the
thread that started it ends) and ends by itself when the parent's end of the pipe closes.

Nothing here imports torch at module level: the process is tuned before torch loads.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import traceback
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from vmkv.config import EngineConfig

if TYPE_CHECKING:
    from vmkv.engine.llm_engine import LLMEngine
    from vmkv.engine.outputs import RequestOutput

logger = logging.getLogger("vmkv")

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
#: seconds an idle replica waits for a command before looking again
IDLE_POLL = 0.5


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent goes (Linux; elsewhere the closed
    pipe ends it); exit now if the parent is already gone."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            logger.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    if os.getppid() != parent_pid:  # it died before the prctl took effect
        os._exit(1)


def run_replica(index: int, config: EngineConfig, conn: Connection, parent_pid: int,
                num_threads: int, log_level: int) -> None:
    """The replica process's main: build the engine, then serve the parent's commands."""
    die_with_parent(parent_pid)
    logging.basicConfig(level=log_level,
                        format=f"%(asctime)s %(levelname)s %(name)s[replica {index}]: "
                               "%(message)s")
    from vmkv.process_tuning import tune_process

    tune_process()  # malloc; the OpenMP variables came with the parent's environment
    import torch

    if config.device == "cpu":
        torch.set_num_threads(num_threads)
    from vmkv.engine.llm_engine import LLMEngine

    try:
        engine = LLMEngine(config)
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        conn.send(("failed", None, _sendable(exc)))
        return
    conn.send(("ready", None, os.getpid()))
    try:
        ReplicaLoop(engine, conn).run()
    except (EOFError, OSError):  # the parent is gone
        pass
    except BaseException:  # noqa: BLE001 - a failed step: the parent fails our streams
        logger.exception("replica %d: engine loop died", index)
        with contextlib.suppress(Exception):  # the parent may be gone already
            conn.send(("died", None, traceback.format_exc(limit=5)))
        engine.close()
        sys.exit(1)
    engine.close()


class ReplicaLoop:
    """Commands between steps, one step at a time, outputs back (as AsyncEngine's thread)."""

    def __init__(self, engine: LLMEngine, conn: Connection) -> None:
        from vmkv.engine.async_engine import admit  # loads torch: not at module level

        self.engine = engine
        self.conn = conn
        self._admit = admit

    def run(self) -> None:
        """Until ``stop`` (returns) or the parent's end closes (EOFError)."""
        while True:
            busy = self.engine.has_unfinished_requests()
            if not self._drain(timeout=0 if busy else IDLE_POLL):
                return
            if self.engine.has_unfinished_requests():
                outputs = self.engine.step()
                if outputs:
                    self.conn.send(("outputs", None, outputs))
            else:  # idle: a dead tensor-parallel rank of this replica fails it now
                self.engine.check_health()

    def _drain(self, timeout: float) -> bool:
        """Handle every waiting command; False once told to stop."""
        outputs: list[RequestOutput] = []
        try:
            while self.conn.poll(timeout):
                timeout = 0
                kind, call_id, payload = self.conn.recv()
                if kind == "stop":
                    return False
                self._handle(kind, call_id, payload, outputs)
        finally:
            if outputs:
                self.conn.send(("outputs", None, outputs))
        return True

    def _handle(self, kind: str, call_id: int | None, payload: Any,
                outputs: list[RequestOutput]) -> None:
        try:
            if kind == "add":
                self._admit(self.engine, *payload)
                result = None
            elif kind == "abort":
                self._abort(*payload, outputs)
                result = None
            elif kind == "abort_all":
                ids = list(self.engine.requests)
                for request_id in ids:
                    self._abort(request_id, payload, outputs)
                result = len(ids)
            elif kind == "call":
                result = payload(self.engine)
            else:
                raise ValueError(f"unknown replica command {kind!r}")
        except Exception as exc:  # bad input: the caller gets it, the loop goes on
            if call_id is None:
                logger.warning("%s %r failed: %s", kind, payload, exc)
            else:
                self._reply(call_id, False, exc)
            return
        if call_id is not None:
            self._reply(call_id, True, result)

    def _abort(self, request_id: str, reason: str | None, outputs: list[RequestOutput]) -> None:
        out = self.engine.abort_request(request_id, reason)
        if out is not None:
            outputs.append(out)

    def _reply(self, call_id: int, ok: bool, value: Any) -> None:
        try:
            self.conn.send(("reply", call_id, (ok, value)))
        except (EOFError, OSError):
            raise
        except Exception as exc:  # noqa: BLE001 - the value does not pickle
            self.conn.send(("reply", call_id, (False, RuntimeError(
                f"the result {type(value).__name__} cannot be sent back: {exc}"))))


def _sendable(exc: BaseException) -> BaseException:
    """``exc`` if it pickles, else a RuntimeError with its text."""
    import pickle

    try:
        pickle.dumps(exc)
        return exc
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(exc).__name__}: {exc}")

