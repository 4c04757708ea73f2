"""One data-parallel replica: an :class:`LLMEngine` in its own process, driven over a
``multiprocessing`` Connection (the child side; the parent's is vmkv/engine/replica_client.py).

The parent sends ``(call_id, command)`` pairs, the commands typed (vmkv/commands.py) and run by
the dispatcher the async engine's thread uses (vmkv/engine/commands.py); ``call_id`` None asks
for no reply. The replica sends ``(kind, call_id, payload)`` tuples, pickled by the Connection:

    parent -> replica                          replica -> parent
    (id, Add(...))                      ->     ("reply", id, (True, None)) or
                                               ("reply", id, (False, ValueError(...)))
    (None, Abort(request_id, reason))   ->     its final output with the next outputs
    (id, AbortAll(reason))              ->     final outputs, ("reply", id, (True, n))
    (id, Call(fn))                      ->     ("reply", id, (True, fn(engine)))
    (None, Stop())                      ->     the engine closes, the process exits 0
                                               ("outputs", None, [RequestOutput, ...]) after
                                               every step that changed requests: deltas for
                                               the server's DELTA requests

At start the replica sends ``("ready", None, pid)``, or ``("failed", None, exception)`` and
exits. A step that raises sends ``("died", None, traceback)`` and exits 1: the parent fails the
replica's streams. The replica dies with its parent (vmkv/parent_death.py: SIGKILL when the
thread that started it ends) and ends by itself when the parent's end of the pipe closes. An
Add whose grammar is not compiled yet compiles on a helper thread while the replica steps.

Nothing here imports torch at module level: the process is tuned before torch loads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import traceback
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from vmkv.commands import Command, Stop
from vmkv.config import EngineConfig
from vmkv.parent_death import die_with_parent

if TYPE_CHECKING:
    from vmkv.engine.llm_engine import LLMEngine
    from vmkv.engine.outputs import RequestOutput

logger = logging.getLogger("vmkv")

#: seconds an idle replica waits for a command before looking again
IDLE_POLL = 0.5
#: seconds it waits while a request's grammar compiles on the helper thread
COMPILE_POLL = 0.01


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
        from vmkv.engine.commands import CommandRunner  # loads torch: not at module level

        self.engine = engine
        self.conn = conn
        self._outputs: list[RequestOutput] = []  # final outputs of aborts, sent after a drain
        self._commands = CommandRunner(engine, self._outputs.append)

    def run(self) -> None:
        """Until Stop (returns) or the parent's end closes (EOFError)."""
        try:
            while True:
                busy = self.engine.has_unfinished_requests()
                if not self._drain(timeout=0 if busy else
                                   COMPILE_POLL if self._commands.waiting else IDLE_POLL):
                    return
                self._commands.poll()
                self._flush()
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    if outputs:
                        self.conn.send(("outputs", None, outputs))
                else:  # idle: a dead tensor-parallel rank of this replica fails it now
                    self.engine.check_health()
        finally:
            self._commands.close()

    def _drain(self, timeout: float) -> bool:
        """Handle every waiting command; False once told to stop."""
        try:
            while self.conn.poll(timeout):
                timeout = 0
                call_id, command = self.conn.recv()
                if isinstance(command, Stop):
                    return False
                self._handle(call_id, command)
        finally:
            self._flush()
        return True

    def _handle(self, call_id: int | None, command: Command) -> None:
        def done(ok: bool, value: Any) -> None:
            if call_id is not None:
                self._reply(call_id, ok, value)
            elif not ok:
                logger.warning("%r failed: %s", command, value)

        self._commands.run(command, done)

    def _flush(self) -> None:
        if self._outputs:
            outputs = list(self._outputs)
            self._outputs.clear()
            self.conn.send(("outputs", None, outputs))

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

