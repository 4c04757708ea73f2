"""The commands that drive an engine loop between steps, as typed values.

    Add(request_id, prompt, params, ...)   queue a request (ValueError for a bad one)
    Abort(request_id, reason)              stop one; its final output is delivered
    AbortAll(reason)                       stop every one; result: how many
    Call(fn)                               ``fn(engine)`` between steps; result: its return
    Stop()                                 end the loop

The async engine's thread and a data-parallel replica run them with one engine loop
(:class:`vmkv.engine.engine_loop.EngineLoop`, its dispatcher
:class:`vmkv.engine.dispatcher.CommandDispatcher`), which ends on :class:`Stop`; so does a
tensor-parallel worker's loop. They travel pickled to replica processes and workers, so this
module imports nothing heavy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vmkv.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class Add:
    """Queue a request unless ``max_waiting`` sequences already wait."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    cache_salt: str | None = None
    max_waiting: int | None = None


@dataclass(frozen=True, slots=True)
class Abort:
    """Stop a request (no-op if unknown or finished); ``reason`` becomes its stop_reason."""

    request_id: str
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class AbortAll:
    """Abort every request, as :class:`Abort` does."""

    reason: str | None = None


@dataclass(frozen=True, slots=True)
class Call:
    """Run ``fn(engine)`` between steps (picklable for a replica: a module-level function)."""

    fn: Callable[[Any], Any]


@dataclass(frozen=True, slots=True)
class Stop:
    """End the loop."""


Command = Add | Abort | AbortAll | Call | Stop
