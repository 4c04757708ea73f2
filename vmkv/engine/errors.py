"""Why an engine loop refuses work (raised to the callers of the async and replica engines)."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an error; no request can be served."""


class EngineOverloadedError(RuntimeError):
    """Too many requests are already waiting; this one was not queued (retry later)."""
