"""A KV manager's decisions as data, and the one funnel through which its state changes.

    rank 0:  scheduler ─▶ KVCacheManager decides (slots, pages, blocks, evictions, copies)
                             │ each decision is a KVChange, applied by ChangeLog.commit: the
                             │ only code that changes the state a rank shares, and the only
                             │ code that appends to the log (changes.record() on rank 0)
             step message ◀──┘ changes.take(): this step's changes, in order, as applied
    rank r:  changes.apply(list): the same commit, change by change, deciding nothing

The managers of all ranks have the same geometry (page or block counts, slots; only the bytes
per token differ), so rank 0's page ids, slot ids and block ids mean the same on every rank: a
worker takes the exact pages rank 0 chose (:meth:`~vmkv.memory.pool.PagePool.take`). Data
moves (copy-on-write, swaps) are changes too, applied in order with the mappings, so each rank
copies its own heads' bytes where rank 0 copied its own.

A change may leave one choice to the rank that applies it (:class:`MapFresh`, a
:class:`CopyPage` without pages: which free pool pages); rank 0 applies it and logs what it
became (:class:`MapPages`, a :class:`CopyPage` with its pages), so the log holds exactly what was
applied and a follower never chooses. Because every mutation of the shared state is a commit,
a new mutation cannot be left out of what the other ranks apply (tests/test_kv_changes.py).

Every change is a small dataclass that pickles (the list travels with the step) and is never
changed once made; not frozen, because a frozen dataclass costs twice as much to make and
rank 0 makes a :class:`Tokens` per request per step.
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from vmkv.memory.errors import MappingBudgetExceeded

# -- both modes -----------------------------------------------------------------------------------


@dataclass(slots=True)
class Tokens:
    """``request_id`` now has room for ``num_tokens`` tokens."""

    request_id: str
    num_tokens: int


@dataclass(slots=True)
class Forget:
    """``request_id`` holds nothing any more (freed, swapped out, preempted)."""

    request_id: str


@dataclass(slots=True)
class SwapOut:
    """Copy ``request_id``'s KV at ``where`` to host memory (before it is freed).

    ``where``: virtual mode ``(first va page, pages)``, paged mode the block ids."""

    request_id: str
    where: tuple[int, ...]


@dataclass(slots=True)
class SwapIn:
    """Copy ``request_id``'s saved KV back to ``where`` (after its memory was mapped)."""

    request_id: str
    where: tuple[int, ...]


@dataclass(slots=True)
class DropSwapped:
    """Forget the saved KV of these requests (rank 0 dropped theirs: aborted while out)."""

    request_ids: tuple[str, ...]


# -- virtual mode ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Place:
    """``request_id`` holds virtual slot ``slot``."""

    request_id: str
    slot: int


@dataclass(slots=True)
class MapFresh:
    """Map ``num`` free pool pages (the applier's choice) at ``va_page`` of every region;
    logged as the :class:`MapPages` it became. Rank 0's decision only: never in a log."""

    va_page: int
    num: int


@dataclass(slots=True)
class MapPages:
    """Map ``pages[r]`` at ``va_page`` of region ``r``: pages taken from the pool now
    (``fresh``) or already in use (a fork's or the prefix cache's: shared)."""

    va_page: int
    pages: tuple[tuple[int, ...], ...]
    fresh: bool


@dataclass(slots=True)
class UnmapPages:
    """Unmap ``num`` pages at ``va_page`` in every region."""

    va_page: int
    num: int


@dataclass(slots=True)
class DropPages:
    """Unmap ``num`` pages at ``va_page`` in the sliding-window regions only (behind every
    window: back to the pool)."""

    va_page: int
    num: int


@dataclass(slots=True)
class CopyPage:
    """Copy-on-write: ``va_page`` gets ``pages[r]`` (fresh) in region ``r``, with its data
    (``None``: free pool pages of the applier's choice, logged with the pages it took)."""

    va_page: int
    pages: tuple[int, ...] | None = None


@dataclass(slots=True)
class HoldPages:
    """The prefix cache takes (``hold``) or drops a reference on these pages."""

    pages: tuple[int, ...]
    hold: bool


@dataclass(slots=True)
class TrimPool:
    """Return idle pool pages to the OS/driver beyond ``keep`` (None: the pool's default)."""

    keep: int | None


# -- paged mode -----------------------------------------------------------------------------------


@dataclass(slots=True)
class SetTable:
    """``request_id``'s block table (of block group ``group``) from index ``start`` on is
    ``blocks``."""

    request_id: str
    start: int
    blocks: tuple[int, ...]
    group: int = 0


@dataclass(slots=True)
class CopyBlock:
    """Copy-on-write: block ``dst`` gets a copy of block ``src`` (every layer)."""

    src: int
    dst: int


KVChange = (Tokens | Forget | SwapOut | SwapIn | DropSwapped | Place | MapFresh | MapPages
            | UnmapPages | DropPages | CopyPage | HoldPages | TrimPool | SetTable | CopyBlock)


def _leaves_a_choice(change: KVChange) -> bool:
    return isinstance(change, MapFresh) or isinstance(change, CopyPage) and change.pages is None


class ChangeLog(ABC):
    """The state a KV manager shares with the other tensor-parallel ranks, and the one funnel
    that changes it: :meth:`commit` applies a change and, while recording, logs it as applied.

    A mode's state (:class:`~vmkv.kv.virtual.state.VirtualState`,
    :class:`~vmkv.kv.paged.state.PagedState`) subclasses this and implements
    :meth:`_apply_one`; the manager's parts change that state only through :meth:`commit`.
    """

    def __init__(self) -> None:
        self._log: list[KVChange] | None = None
        # swapped-out requests whose saved KV the other ranks hold: dropped when rank 0's is
        self._swapped_out: weakref.WeakValueDictionary[str, object] = (
            weakref.WeakValueDictionary())
        self._swaps_held: set[str] = set()

    @property
    def recording(self) -> bool:
        """Whether :meth:`commit` logs (rank 0 of tensor parallelism)."""
        return self._log is not None

    def record(self) -> None:
        """From now on, log every change applied (rank 0 of tensor parallelism)."""
        self._log = []

    def commit(self, change: KVChange) -> KVChange | None:
        """Apply ``change`` and, while recording, log it as applied (a choice it left made);
        returns that, or None when it cannot be applied (the pool or the mapping budget is
        short: nothing changed, nothing logged). Errors of the state (``KeyError`` for an
        unknown request, ``VmmError`` from the OS) propagate, nothing logged."""
        applied = self._apply_one(change)
        if applied is not None and self._log is not None:
            self._log.append(applied)
        return applied

    def take(self) -> list[KVChange]:
        """The changes applied since the last take, in order (empty when not recording); ends
        with a :class:`DropSwapped` for saved KV rank 0 no longer holds."""
        dropped = tuple(r for r in self._swaps_held if r not in self._swapped_out)
        if dropped:
            self._swaps_held.difference_update(dropped)
            self.commit(DropSwapped(dropped))
        if self._log is None:
            return []
        changes, self._log = self._log, []
        return changes

    def apply(self, changes: Sequence[KVChange]) -> None:
        """Make the changes another manager of the same geometry took, through the same
        :meth:`commit`, deciding nothing: the same slots, pages or blocks, the same copies of
        this manager's own bytes. Raises ValueError for a change that leaves a choice, and
        :class:`MappingBudgetExceeded` (or ``ValueError`` for a page not free) when this rank
        cannot do what rank 0 did."""
        for change in changes:
            if _leaves_a_choice(change):
                raise ValueError(f"{change!r} leaves a choice: a follower applies only what "
                                 "rank 0 chose")
            if self.commit(change) is None:  # only a budget this rank does not share
                raise MappingBudgetExceeded(f"could not apply {change!r} as rank 0 did")

    def track_swap_out(self, request_id: str, swapped: object) -> None:
        """While recording: the other ranks now hold ``request_id``'s saved KV, until it swaps
        back in or ``swapped`` (rank 0's copy) is dropped (:meth:`take` then drops theirs)."""
        if self._log is not None:
            self._swapped_out[request_id] = swapped
            self._swaps_held.add(request_id)

    def track_swap_in(self, request_id: str) -> None:
        """``request_id``'s saved KV went back to device memory on every rank."""
        self._swaps_held.discard(request_id)

    @abstractmethod
    def _apply_one(self, change: KVChange) -> KVChange | None:
        """Change the state as ``change`` says; the change as applied, or None (nothing
        changed) when it cannot be. The only code that changes the shared state."""
