"""A KV manager's decisions as data: the changes rank 0's manager made, which the other
tensor-parallel ranks apply to their own managers without deciding anything again.

    rank 0:  scheduler ─▶ KVCacheManager (decides: slots, pages, blocks, evictions, copies)
                             │ record_changes(): every change it makes is also logged
             step message ◀──┘ take_changes(): this step's list, in order
    rank r:  KVCacheManager.apply_changes(list): the same pages and blocks, the same copies

The managers of all ranks have the same geometry (page or block counts, slots; only the bytes
per token differ), so rank 0's page ids, slot ids and block ids mean the same on every rank: a
worker takes the exact pages rank 0 chose (:meth:`~vmkv.memory.pool.PagePool.take`). Data
moves (copy-on-write, swaps) are changes too, applied in order with the mappings, so each rank
copies its own heads' bytes where rank 0 copied its own.

Every change is a small frozen dataclass that pickles: the list travels with the step.
"""

from __future__ import annotations

from dataclasses import dataclass

# -- both modes -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Tokens:
    """``request_id`` now has room for ``num_tokens`` tokens."""

    request_id: str
    num_tokens: int


@dataclass(frozen=True, slots=True)
class Forget:
    """``request_id`` holds nothing any more (freed, swapped out, preempted)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class SwapOut:
    """Copy ``request_id``'s KV at ``where`` to host memory (before it is freed).

    ``where``: virtual mode ``(first va page, pages)``, paged mode the block ids."""

    request_id: str
    where: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SwapIn:
    """Copy ``request_id``'s saved KV back to ``where`` (after its memory was mapped)."""

    request_id: str
    where: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class DropSwapped:
    """Forget the saved KV of these requests (rank 0 dropped theirs: aborted while out)."""

    request_ids: tuple[str, ...]


# -- virtual mode ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Place:
    """``request_id`` holds virtual slot ``slot``."""

    request_id: str
    slot: int


@dataclass(frozen=True, slots=True)
class MapPages:
    """Map ``pages[r]`` at ``va_page`` of region ``r``: pages taken from the pool now
    (``fresh``) or already in use (a fork's or the prefix cache's: shared)."""

    va_page: int
    pages: tuple[tuple[int, ...], ...]
    fresh: bool


@dataclass(frozen=True, slots=True)
class UnmapPages:
    """Unmap ``num`` pages at ``va_page`` in every region."""

    va_page: int
    num: int


@dataclass(frozen=True, slots=True)
class CopyPage:
    """Copy-on-write: ``va_page`` gets ``pages[r]`` (fresh) in region ``r``, with its data."""

    va_page: int
    pages: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class HoldPages:
    """The prefix cache takes (``hold``) or drops a reference on these pages."""

    pages: tuple[int, ...]
    hold: bool


@dataclass(frozen=True, slots=True)
class TrimPool:
    """Return idle pool pages to the OS/driver beyond ``keep`` (None: the pool's default)."""

    keep: int | None


# -- paged mode -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SetTable:
    """``request_id``'s block table from index ``start`` on is ``blocks``."""

    request_id: str
    start: int
    blocks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CopyBlock:
    """Copy-on-write: block ``dst`` gets a copy of block ``src`` (every layer)."""

    src: int
    dst: int


KVChange = (Tokens | Forget | SwapOut | SwapIn | DropSwapped | Place | MapPages | UnmapPages
            | CopyPage | HoldPages | TrimPool | SetTable | CopyBlock)
