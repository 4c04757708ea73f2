"""The one loop that drives an :class:`~vmkv.engine.llm_engine.LLMEngine` for callers
elsewhere: commands between steps, one step at a time, outputs out. Where the commands come
from and where the outputs go is its :class:`Transport`:

    AsyncEngine (vmkv/engine/async_engine.py)   a thread queue; outputs to asyncio streams
    a replica  (vmkv/engine/replica.py)         a multiprocessing pipe to the parent

    until Stop:
        receive every waiting command (wait up to IDLE_POLL when idle, COMPILE_POLL while a
        grammar compiles, not at all while requests run); the dispatcher runs each
        admit the requests whose grammar is compiled now
        requests?  step, send its outputs  |  none: check the ranks' health

Nothing here imports torch: a replica's process is tuned before torch loads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from vmkv.commands import Command, Stop
from vmkv.engine.dispatcher import CommandDispatcher, Done

if TYPE_CHECKING:
    from vmkv.engine.llm_engine import LLMEngine
    from vmkv.engine.outputs import RequestOutput

#: seconds an idle loop waits for a command before checking the ranks' health
IDLE_POLL = 0.5
#: seconds it waits while a request's grammar compiles on the dispatcher's helper thread
COMPILE_POLL = 0.01


class Transport(Protocol):
    """How an engine loop meets its callers (called on the loop's thread only)."""

    def receive(self, timeout: float) -> tuple[Command, Done] | None:
        """The next command and how to answer it, waiting up to ``timeout`` seconds (0: only
        one already there); None when none came."""
        ...

    def send(self, outputs: list[RequestOutput]) -> None:
        """Hand outputs to their readers: a step's, or the final output of an abort."""
        ...


class EngineLoop:
    """Runs ``engine`` over ``transport`` (see the module); :meth:`run` until Stop.

    An exception out of :meth:`run` (a failed step, a transport gone) is the caller's to
    report; the requests still compiling their grammar are answered with EngineDeadError
    either way."""

    def __init__(self, engine: LLMEngine, transport: Transport) -> None:
        self.engine = engine
        self.transport = transport
        self.commands = CommandDispatcher(engine, self._deliver)

    def run(self) -> None:
        """Until a Stop command (returns) or an exception (raised)."""
        engine = self.engine
        try:
            while True:
                busy = engine.has_unfinished_requests()
                if not self._receive(timeout=0 if busy else
                                     COMPILE_POLL if self.commands.waiting else IDLE_POLL):
                    return
                self.commands.poll()
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    if outputs:
                        self.transport.send(outputs)
                else:  # idle: a dead tensor-parallel rank must not wait for the next request
                    engine.check_health()
        finally:
            self.commands.close()

    def _receive(self, timeout: float) -> bool:
        """Run every waiting command; False once told to stop."""
        while (received := self.transport.receive(timeout)) is not None:
            timeout = 0
            command, done = received
            if isinstance(command, Stop):
                return False
            self.commands.run(command, done)
        return True

    def _deliver(self, out: RequestOutput) -> None:
        self.transport.send([out])
