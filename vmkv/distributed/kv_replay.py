"""Every rank's KV manager takes the same decisions: rank 0 records its calls, workers replay.

    rank 0:  scheduler/engine ─▶ RecordingKV ─▶ its KVCacheManager       (decides)
                                    │ calls, in order, with their results
             step message ──────────┘
    rank r:  KVReplayer ─▶ its KVCacheManager (its heads' KV)           (applies, compares)

The managers of all ranks have the same geometry (same page/block counts, same slot count;
only the bytes per token differ), so the same calls in the same order give the same slot ids,
block tables and prefix-cache units: the attention kernels of every rank read the same rows.
A different result on a worker (a page the OS refused on one rank only) is a
:class:`KVDivergedError`; the debug mode (``VMKV_TP_CHECK=1``) also compares a digest of
each manager's state after every step (:func:`kv_digest`).
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from vmkv.distributed.collectives import agree_min
from vmkv.kv.base import KVCacheManager, SwappedKV, VmmError

#: the manager calls that change its state (everything else only reads it)
MUTATIONS = frozenset({"allocate", "free", "fork", "swap_out", "swap_in", "match_prefix",
                       "cache_computed", "reset_prefix_cache"})

RAISED = "raised VmmError"


class KVDivergedError(RuntimeError):
    """A worker's KV manager answered a call differently from rank 0's."""


#: the calls that take a request's token ids (argument 1): sent as deltas
TOKEN_CALLS = frozenset({"match_prefix", "cache_computed"})


@dataclass(frozen=True)
class TokenDelta:
    """A request's token ids from ``start`` on; the receiver holds the ones before."""

    start: int
    tokens: list[int]


@dataclass(frozen=True)
class KVCall:
    """One recorded call: its name, arguments (a swap-in's data stays on each rank) and what
    rank 0 got (``RAISED`` for a VmmError; None for a swap-out)."""

    name: str
    args: tuple[Any, ...]
    result: Any


class RecordingKV:
    """Rank 0's manager, recording each mutating call; reads pass straight through."""

    def __init__(self, kv: KVCacheManager) -> None:
        self._kv = kv
        self._calls: list[KVCall] = []
        # swap-outs whose data the scheduler still holds (dropped with the sequence)
        self._swapped: weakref.WeakValueDictionary[str, SwappedKV] = (
            weakref.WeakValueDictionary())
        # per request: the token list last sent and how much of it (a sequence's list only
        # grows, so each step sends the new tokens, not the whole context again)
        self._sent: dict[str, tuple[Sequence[int], int]] = {}

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._kv, name)
        if name not in MUTATIONS:
            return attr

        def recorded(*args: Any) -> Any:
            logged = args[:1] if name == "swap_in" else args
            if name in TOKEN_CALLS:
                logged = (args[0], self._delta(args[0], args[1]), *args[2:])
            elif name == "free":
                self._sent.pop(args[0], None)
            try:
                result = attr(*args)
            except VmmError:
                self._calls.append(KVCall(name, logged, RAISED))
                raise
            if name == "swap_out":
                self._swapped[args[0]] = result
                self._calls.append(KVCall(name, logged, None))
            else:
                self._calls.append(KVCall(name, logged, result))
            return result

        return recorded

    def _delta(self, request_id: str, token_ids: Sequence[int]) -> TokenDelta:
        last = self._sent.get(request_id)
        start = 0
        if last is not None and last[0] is token_ids and len(token_ids) >= last[1]:
            start = last[1]
        self._sent[request_id] = (token_ids, len(token_ids))
        return TokenDelta(start, list(token_ids[start:]))

    def take_calls(self) -> list[KVCall]:
        """The calls since the last take, in order."""
        calls, self._calls = self._calls, []
        return calls

    def swapped_ids(self) -> list[str]:
        """Requests whose swapped-out KV is still held (workers drop the others' copies)."""
        return list(self._swapped.keys())


class KVReplayer:
    """A worker's manager, driven by rank 0's recorded calls."""

    def __init__(self, kv: KVCacheManager, rank: int) -> None:
        self.kv = kv
        self.rank = rank
        self.swapped: dict[str, SwappedKV] = {}
        self.tokens: dict[str, list[int]] = {}  # per request: its token ids so far

    def apply(self, calls: Iterable[KVCall], swapped_ids: Iterable[str]) -> None:
        """Make the same calls in order; KVDivergedError when an answer differs."""
        for call in calls:
            result = self._call(call)
            if result != call.result:
                raise KVDivergedError(
                    f"tensor-parallel rank {self.rank}: KV {call.name}{call.args[:2]} gave "
                    f"{result!r}, rank 0 got {call.result!r}")
        keep = set(swapped_ids)
        for request_id in [r for r in self.swapped if r not in keep]:
            del self.swapped[request_id]

    def _call(self, call: KVCall) -> Any:
        fn = getattr(self.kv, call.name)
        args = call.args
        if call.name in TOKEN_CALLS:
            delta = args[1]
            if delta.start == 0:
                self.tokens[args[0]] = []
            tokens = self.tokens[args[0]]
            del tokens[delta.start:]
            tokens.extend(delta.tokens)
            args = (args[0], tokens, *args[2:])
        elif call.name == "free":
            self.tokens.pop(args[0], None)
        try:
            if call.name == "swap_out":
                self.swapped[args[0]] = fn(*args)
                return None
            if call.name == "swap_in":
                done = fn(args[0], self.swapped[args[0]])
                if done:
                    del self.swapped[args[0]]
                return done
            return fn(*args)
        except VmmError:
            return RAISED


def kv_digest(kv: KVCacheManager | RecordingKV) -> str:
    """A hash of what the kernels read and the accounting: every request's token count and
    rows (slot ids or block table) and the free units (not the usage: the OS's counts of a
    rank's memory, huge pages for one, may differ where the decisions do not)."""
    ids = sorted(kv.request_ids())
    h = hashlib.sha256(repr((ids, [kv.num_tokens(r) for r in ids], kv.free_units)).encode())
    if ids:
        addressing = kv.addressing(ids, [0] * len(ids))
        for f in fields(addressing):
            value = getattr(addressing, f.name)
            h.update(value.tobytes() if isinstance(value, np.ndarray) else repr(value).encode())
    return h.hexdigest()


#: a VMA budget larger than any real one (a rank without a budget)
NO_BUDGET = 1 << 62


def agree_vma_budget(kv: KVCacheManager, timeout: float | None = None,
                     alive: Callable[[], None] | None = None) -> None:
    """Every rank's manager takes the smallest VMA budget of all ranks (a per-process quantity
    that would otherwise let the same call succeed on one rank and fail on another). A
    collective on the control group: also the ranks' "ready" barrier."""
    budget = agree_min(kv.vma_budget or NO_BUDGET, timeout, alive)
    if budget < NO_BUDGET:
        kv.limit_vma_budget(budget)
