"""One data-parallel replica: an :class:`LLMEngine` in its own process, driven over a
``multiprocessing`` Connection (the child side; the parent's is vmkv/engine/replica_client.py).

The parent sends ``(call_id, command)`` pairs, the commands typed (vmkv/commands.py) and run by
the engine loop the async engine's thread runs too (vmkv/engine/engine_loop.py), here over the
pipe (:class:`PipeTransport`); ``call_id`` None asks for no reply. The replica sends
``(kind, call_id, payload)`` tuples, pickled by the Connection:

    parent -> replica                          replica -> parent
    (id, Add(...))                      ->     ("reply", id, (True, None)) or
                                               ("reply", id, (False, ValueError(...)))
    (None, Abort(request_id, reason))   ->     ("outputs", None, [its final output])
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

from vmkv.commands import Command
from vmkv.config import EngineConfig
from vmkv.engine.dispatcher import Done
from vmkv.engine.engine_loop import EngineLoop
from vmkv.parent_death import die_with_parent

if TYPE_CHECKING:
    from vmkv.engine.outputs import RequestOutput

logger = logging.getLogger("vmkv")


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
        EngineLoop(engine, PipeTransport(conn)).run()
    except (EOFError, OSError):  # the parent is gone
        pass
    except BaseException:  # noqa: BLE001 - a failed step: the parent fails our streams
        logger.exception("replica %d: engine loop died", index)
        with contextlib.suppress(Exception):  # the parent may be gone already
            conn.send(("died", None, traceback.format_exc(limit=5)))
        engine.close()
        sys.exit(1)
    engine.close()


class PipeTransport:
    """The engine loop's side of the parent's pipe (see the module): ``(call_id, command)``
    in, replies and outputs out."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def receive(self, timeout: float) -> tuple[Command, Done] | None:
        """The next command from the parent (EOFError once its end closed)."""
        if not self.conn.poll(timeout):
            return None
        call_id, command = self.conn.recv()
        return command, self._answer(call_id, command)

    def send(self, outputs: list[RequestOutput]) -> None:
        self.conn.send(("outputs", None, outputs))

    def _answer(self, call_id: int | None, command: Command) -> Done:
        def done(ok: bool, value: Any) -> None:
            if call_id is not None:
                self._reply(call_id, ok, value)
            elif not ok:
                logger.warning("%r failed: %s", command, value)

        return done

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

