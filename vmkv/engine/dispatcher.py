"""The one dispatcher of engine commands (vmkv/commands.py): the engine loop
(vmkv/engine/engine_loop.py) of the async engine's thread and of a data-parallel replica runs
:meth:`CommandDispatcher.run` between steps.

    run(Add)       grammar compiled?  yes: admit now, answer ``done(True, None)``
                                      no:  compile on a helper thread; :meth:`poll` admits
                                           once it is ready (the engine steps meanwhile)
    run(Abort)     abort (or drop the Add still waiting for its grammar); the final output
                   goes to ``deliver``
    run(AbortAll)  every request and every waiting Add; ``done(True, how many)``
    run(Call)      ``done(True, fn(engine))``

(``Stop`` never reaches it: the loop ends on it.)

``done(ok, value)`` is the caller's answer (a future, a reply over a pipe); a bad command
answers ``done(False, exception)`` and the loop goes on.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vmkv.commands import Abort, AbortAll, Add, Call, Command
from vmkv.engine.errors import EngineDeadError, EngineOverloadedError

if TYPE_CHECKING:
    from vmkv.engine.llm_engine import LLMEngine
    from vmkv.engine.outputs import RequestOutput

#: the answer to one command: ``done(True, result)`` or ``done(False, exception)``
Done = Callable[[bool, Any], None]


def admit(engine: LLMEngine, add: Add) -> None:
    """Queue a request unless ``max_waiting`` sequences already wait (EngineOverloadedError);
    ValueError for a bad request. Nothing is queued when it raises."""
    waiting = len(engine.scheduler.waiting)
    if add.max_waiting is not None and waiting >= add.max_waiting:
        raise EngineOverloadedError(f"{waiting} requests are already waiting")
    engine.add_request(add.request_id, add.prompt, add.params, cache_salt=add.cache_salt)


class CommandDispatcher:
    """Runs commands on one engine, on the thread that steps it (see the module)."""

    def __init__(self, engine: LLMEngine, deliver: Callable[[RequestOutput], None]) -> None:
        self.engine = engine
        self.deliver = deliver
        self._compiling: dict[str, tuple[Add, Done, concurrent.futures.Future]] = {}
        self._compiler: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def waiting(self) -> bool:
        """Whether an Add waits for its grammar (the loop must :meth:`poll` soon)."""
        return bool(self._compiling)

    def run(self, command: Command, done: Done) -> None:
        """Run ``command`` now (an Add may wait for its grammar: see :meth:`poll`)."""
        try:
            if isinstance(command, Add):
                if not self._grammar_ready(command, done):
                    return
                admit(self.engine, command)
                result = None
            elif isinstance(command, Abort):
                self._abort(command.request_id, command.reason)
                result = None
            elif isinstance(command, AbortAll):
                ids = [*self.engine.requests, *self._compiling]
                for request_id in ids:
                    self._abort(request_id, command.reason)
                result = len(ids)
            elif isinstance(command, Call):
                result = command.fn(self.engine)
            else:
                raise ValueError(f"unknown engine command {command!r}")
        except Exception as exc:  # bad input: the caller gets it, the loop goes on
            done(False, exc)
            return
        done(True, result)

    def poll(self) -> None:
        """Admit the Adds whose grammar is compiled now (or answer their compile error)."""
        for request_id, (add, done, future) in list(self._compiling.items()):
            if future.done():
                del self._compiling[request_id]
                error = future.exception()
                if error is not None:
                    done(False, error)
                else:
                    self.run(add, done)

    def close(self) -> None:
        """Drop the Adds still compiling and stop the helper thread."""
        for _, done, future in self._compiling.values():
            future.cancel()
            done(False, EngineDeadError("the engine loop stopped"))
        self._compiling.clear()
        if self._compiler is not None:
            self._compiler.shutdown(wait=False, cancel_futures=True)

    # -- inside ---------------------------------------------------------------------------------
    def _grammar_ready(self, add: Add, done: Done) -> bool:
        """True if ``add`` needs no compile now; else start its compile on the helper thread."""
        structure = add.params.structured_outputs
        grammars = self.engine.grammars
        if structure is None or grammars.is_compiled(structure):
            return True
        if add.request_id in self._compiling:
            raise ValueError(f"request id {add.request_id!r} is already in use")
        if self._compiler is None:
            self._compiler = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="vmkv-grammar")
        future = self._compiler.submit(grammars.compile, structure)
        self._compiling[add.request_id] = (add, done, future)
        return False

    def _abort(self, request_id: str, reason: str | None) -> None:
        waiting = self._compiling.pop(request_id, None)
        if waiting is not None:  # never queued: nothing to free, its caller hears why
            waiting[1](False, ValueError(f"request {request_id!r} was aborted before it was "
                                         "queued"))
            return
        out = self.engine.abort_request(request_id, reason)
        if out is not None:
            self.deliver(out)
