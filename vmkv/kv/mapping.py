"""Background pre-mapping as the engine and the executor see it (the thread itself:
:mod:`vmkv.memory.mapper`).

    executor:  kv.mapping.start()               a mapper thread, owned by the manager (CUDA)
    engine:    with kv.mapping.ahead(tokens):   it maps the next tokens' pages while the device
                   sample(...)                  computes; on leaving, wait for it
    graphs:    with kv.mapping.paused():        no map call while a CUDA graph is captured

This base has nothing to pre-map (paged mode, the host); virtual mode's
:class:`~vmkv.kv.virtual.premap.PremapSlots` hands the mapper its units. A manager with a mapper
is never read or changed while a unit runs: :func:`waits_for_mapper` makes every public member
of its class (its parts included: they are properties) wait for the mapper first.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from vmkv.memory.mapper import BackgroundMapper

C = TypeVar("C", bound=type)


class KVMapping:
    """A manager's background mapper, if any: started, fed, paused and closed here."""

    def __init__(self) -> None:
        #: the mapper thread (:meth:`start` or :meth:`attach`), closed with the manager
        self.mapper: BackgroundMapper | None = None

    def start(self) -> BackgroundMapper | None:
        """Start a mapper thread that pre-maps pages while the device computes, owned by the
        manager; None where there is nothing to pre-map."""
        return None

    def attach(self, mapper: BackgroundMapper | None) -> None:
        """Let ``mapper`` pre-map this manager's pages (:meth:`units`); the manager owns it
        from now on and waits for it before every public call."""
        self.mapper = mapper

    def units(self, lookahead_tokens: int) -> list[Callable[[], int]]:
        """Units of work for the mapper: the pages the running requests' next
        ``lookahead_tokens`` tokens need (none here)."""
        return []

    @contextmanager
    def ahead(self, lookahead_tokens: int) -> Iterator[None]:
        """While the body runs (the device computes), the mapper pre-maps the pages the
        running requests' next ``lookahead_tokens`` tokens need; on leaving, wait for it, so
        no KV call between steps ever races with it. Without a mapper: nothing."""
        mapper = self.mapper
        if mapper is None:
            yield
            return
        mapper.submit(self.units(lookahead_tokens))
        try:
            yield
        finally:
            mapper.wait()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No mapping while the body runs (a CUDA graph capture): queued work is drained,
        new work dropped. Without a mapper: nothing."""
        if self.mapper is None:
            yield
            return
        with self.mapper.paused():
            yield

    def close(self) -> None:
        """Stop the mapper thread, if any."""
        if self.mapper is not None:
            self.mapper.close()
            self.mapper = None


def waits_for_mapper(cls: C) -> C:
    """Make every public method and property of the manager class ``cls`` (inherited ones
    included, so its parts too) wait for its mapping part's mapper first, so the manager is
    never read or changed while a mapper unit runs. The class keeps that part in ``_mapping``.
    Private methods and the parts' own methods are not wrapped: the mapper's units call them."""

    def guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            mapper = self._mapping.mapper
            if mapper is not None:
                mapper.wait()
            return fn(self, *args, **kwargs)

        return wrapper

    for name, member in inspect.getmembers(cls):
        if name.startswith("_"):
            continue
        if isinstance(member, property):
            setattr(cls, name, property(guarded(member.fget)))
        elif inspect.isfunction(member):
            setattr(cls, name, guarded(member))
    return cls
