"""Automatic prefix caching: hash-chained units of KV memory shared across requests.

A *unit* is what a KV mode can share: a block of ``block_size`` tokens (paged) or a page
(virtual; a page may hold a fractional number of tokens, so its hash covers every token that
overlaps it). Unit ``i`` of a request is identified by

    hash_i = H(hash_{i-1}, token ids overlapping unit i, extra keys)     (extra: cache_salt, ...)

so a hash names the whole prefix up to the unit: one differing token changes every hash from its
unit on and none before. H is SHA-256 by default (a collision would serve one request another's
KV); ``"builtin"`` (Python's tuple hash, 64 bits) is faster and meant for single-tenant use.

The cache holds one reference on every unit it knows (block ids, or one page id per region), so
cached memory outlives the requests that computed it. A unit referenced only by the cache is
*evictable*; eviction follows LRU order, and a finished request touches its units deepest-first
so its deepest units are evicted first.

The engine sees :class:`PrefixPart` (``kv.prefix``: on or off, match, publish, reset, stats);
the manager's own parts drive :class:`PrefixCaching` (evict, forget, inherit).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

HASH_FUNCTIONS = ("sha256", "builtin")
UnitHash = Hashable


def chain_hasher(name: str) -> Callable[[UnitHash | None, Sequence[int], bytes], UnitHash]:
    """``H(parent, tokens, extra)`` for ``name`` in :data:`HASH_FUNCTIONS`."""
    if name == "sha256":
        def sha256(parent: UnitHash | None, tokens: Sequence[int], extra: bytes) -> bytes:
            h = hashlib.sha256(parent or b"root")
            h.update(struct.pack(f"<I{len(tokens)}q", len(extra), *tokens))
            h.update(extra)
            return h.digest()

        return sha256
    if name == "builtin":
        def builtin(parent: UnitHash | None, tokens: Sequence[int], extra: bytes) -> int:
            return hash((parent, tuple(tokens), extra))

        return builtin
    raise ValueError(f"prefix cache hash must be one of {HASH_FUNCTIONS}, got {name!r}")


class PrefixCache:
    """hash -> unit payload (a block id, or a tuple of page ids), in LRU order.

    Pure bookkeeping: the KV manager owns the reference counts. Every entry stands for one
    reference the manager took when inserting it and drops when evicting it.
    """

    def __init__(self, hash_name: str = "sha256") -> None:
        self.hash = chain_hasher(hash_name)
        self.hash_name = hash_name
        self._entries: OrderedDict[UnitHash, object] = OrderedDict()  # oldest first
        self._hash_of: dict[object, UnitHash] = {}  # payload -> its entry's hash
        self.queries = 0  # tokens looked up (vLLM's prefix_cache_queries)
        self.hits = 0  # tokens found

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, unit_hash: UnitHash) -> bool:
        return unit_hash in self._entries

    def get(self, unit_hash: UnitHash) -> object | None:
        return self._entries.get(unit_hash)

    def lookup(self, hashes: Sequence[UnitHash]) -> list[object]:
        """Payloads of the longest cached prefix of ``hashes`` (touched as recently used)."""
        found = []
        for h in hashes:
            payload = self._entries.get(h)
            if payload is None:
                break
            self._entries.move_to_end(h)
            found.append(payload)
        return found

    def insert(self, unit_hash: UnitHash, payload: object) -> bool:
        """Cache ``payload`` under ``unit_hash``; False if the hash is already cached (the
        caller keeps its duplicate private and takes no extra reference)."""
        if unit_hash in self._entries:
            return False
        self._entries[unit_hash] = payload
        self._hash_of.setdefault(payload, unit_hash)
        return True

    def holds(self, payload: object) -> bool:
        """Whether some entry's payload is ``payload``."""
        return payload in self._hash_of

    def drop(self, payload: object) -> bool:
        """Remove the entry whose payload is ``payload`` (whatever its age); False if none."""
        unit_hash = self._hash_of.pop(payload, None)
        if unit_hash is None:
            return False
        del self._entries[unit_hash]
        return True

    def touch(self, hashes: Iterable[UnitHash]) -> None:
        """Mark as most recently used, in the given order (the last one newest)."""
        for h in hashes:
            if h in self._entries:
                self._entries.move_to_end(h)

    def evict(self, evictable: Callable[[object], bool]) -> tuple[UnitHash, object] | None:
        """Remove and return the least recently used entry ``evictable(payload)`` accepts."""
        for h, payload in self._entries.items():
            if evictable(payload):
                del self._entries[h]
                if self._hash_of.get(payload) == h:
                    del self._hash_of[payload]
                return h, payload
        return None

    def payloads(self) -> Iterable[object]:
        return self._entries.values()

    def record(self, queried: int, hit: int) -> None:
        self.queries += queried
        self.hits += hit


def unit_hashes(hasher: Callable[[UnitHash | None, Sequence[int], bytes], UnitHash],
                token_ids: Sequence[int], spans: Iterable[tuple[int, int]], extra: bytes,
                known: list[UnitHash]) -> list[UnitHash]:
    """Extend ``known`` (the chain so far) over the units whose token ``spans`` ``[a, b)`` are
    all within ``token_ids``; returns ``known`` (mutated)."""
    for i, (a, b) in enumerate(spans):
        if i < len(known):
            continue
        if b > len(token_ids):
            break
        known.append(hasher(known[-1] if known else None, token_ids[a:b], extra))
    return known


class UnitStore(Protocol):
    """What a KV mode tells the prefix cache about its shareable units (blocks or pages): their
    token spans and how a unit's payload (a block id, or one page id per region) is referenced.
    """

    def unit_span(self, i: int) -> tuple[int, int]:
        """``[first_token, end_token)``: the tokens overlapping unit ``i``."""

    def unit_payload(self, request_id: str, i: int) -> object:
        """What holds unit ``i`` of ``request_id`` now."""

    def hold(self, payload: object) -> None:
        """Take one reference on every page or block of ``payload`` (the cache's)."""

    def unhold(self, payload: object) -> None:
        """Drop the reference :meth:`hold` took."""

    def is_cache_only(self, payload: object) -> bool:
        """Whether only the cache references ``payload`` (it can be evicted)."""

    def payload_units(self, payload: object) -> int:
        """Memory units (pages or blocks) ``payload`` frees when evicted."""

    def adopt(self, request_id: str, payloads: list[object]) -> int | None:
        """Give a request that holds nothing the hit units; their tokens, None if it cannot
        (no free slot, mapping budget)."""


class PrefixCaching:
    """Automatic prefix caching over one KV manager's :class:`UnitStore`.

    The manager forwards its requests' life cycle (:meth:`match`, :meth:`publish`,
    :meth:`inherit`, :meth:`forget`) and asks it to :meth:`evict` when memory is short; this class
    keeps the hash chains per request and the cache's references.
    """

    def __init__(self, units: UnitStore, hash_name: str = "sha256") -> None:
        self.units = units
        self.cache = PrefixCache(hash_name)
        self._hashes: dict[str, list[UnitHash]] = {}
        self._registered: dict[str, int] = {}

    def __len__(self) -> int:
        """Units cached."""
        return len(self.cache)

    @property
    def queries(self) -> int:
        return self.cache.queries

    @property
    def hits(self) -> int:
        return self.cache.hits

    def _spans(self) -> Iterable[tuple[int, int]]:
        i = 0
        while True:
            yield self.units.unit_span(i)
            i += 1

    def match(self, request_id: str, token_ids: Sequence[int], cache_salt: str | None) -> int:
        """Give a request that holds no KV yet the longest cached prefix of ``token_ids``;
        returns the tokens it now has. The last token is never taken from the cache: its logits
        must be computed."""
        extra = (cache_salt or "").encode()
        hashes = unit_hashes(self.cache.hash, token_ids[: len(token_ids) - 1], self._spans(),
                             extra, [])
        payloads = self.cache.lookup(hashes)
        tokens = self.units.adopt(request_id, payloads) if payloads else None
        self.cache.record(len(token_ids), tokens or 0)
        if tokens:
            self._hashes[request_id] = hashes
            self._registered[request_id] = len(payloads)
        return tokens or 0

    def publish(self, request_id: str, token_ids: Sequence[int], num_computed: int,
                cache_salt: str | None) -> None:
        """Cache the request's units that ``num_computed`` tokens now fill completely."""
        done = complete = self._registered.get(request_id, 0)
        while self.units.unit_span(complete)[1] <= num_computed:
            complete += 1
        if complete == done:
            return
        hashes = self._hashes.setdefault(request_id, [])
        unit_hashes(self.cache.hash, token_ids[:num_computed], self._spans(),
                    (cache_salt or "").encode(), hashes)
        for i in range(done, complete):
            payload = self.units.unit_payload(request_id, i)
            if self.cache.insert(hashes[i], payload):
                self.units.hold(payload)
        self._registered[request_id] = complete

    def forget(self, request_id: str) -> None:
        """On free: the request's units become recently used, deepest first (so the deepest
        ones are evicted first)."""
        hashes = self._hashes.pop(request_id, [])
        registered = self._registered.pop(request_id, 0)
        self.cache.touch(reversed(hashes[:registered]))

    def inherit(self, parent_id: str, child_id: str) -> None:
        """A fork's child continues its parent's chain."""
        if parent_id in self._hashes:
            self._hashes[child_id] = list(self._hashes[parent_id])
            self._registered[child_id] = self._registered.get(parent_id, 0)

    def evict(self, units_wanted: int) -> int:
        """Evict least recently used cache-only units until ``units_wanted`` are free; returns
        the units freed."""
        freed = 0
        while freed < units_wanted:
            entry = self.cache.evict(self.units.is_cache_only)
            if entry is None:
                break
            self.units.unhold(entry[1])
            freed += self.units.payload_units(entry[1])
        return freed

    def reset(self) -> int:
        """Forget every cached unit (vLLM's ``reset_prefix_cache``); returns how many.

        The cache's own references are released: units only the cache held go back to the free
        pool, units that running requests use stay theirs, no longer shared with later requests.
        Hit statistics are kept. Benchmarks call it so that each repetition starts cold.
        """
        dropped = 0
        while (entry := self.cache.evict(lambda _payload: True)) is not None:
            self.units.unhold(entry[1])
            dropped += 1
        return dropped

    def holds_payload(self, payload: object) -> bool:
        """Whether the cache references ``payload``."""
        return self.cache.holds(payload)

    def release(self, payload: object) -> bool:
        """Drop the cache's entry for ``payload`` and its reference, whatever its age (a KV
        manager reusing the unit in place); False when the cache holds no such entry."""
        if not self.cache.drop(payload):
            return False
        self.units.unhold(payload)
        return True

    def num_evictable(self) -> int:
        """Units that evicting every cache-only entry would free."""
        return sum(self.units.payload_units(p) for p in self.cache.payloads()
                   if self.units.is_cache_only(p))

    def holds(self) -> list[object]:
        """Every payload the cache references (one reference each)."""
        return list(self.cache.payloads())


@dataclass(frozen=True)
class PrefixCacheStats:
    """Prefix caching's counters since start-up: prompt tokens looked up, and found."""

    enabled: bool
    queries: int = 0
    hits: int = 0


class PrefixPart:
    """Prefix caching as the engine sees it (``kv.prefix``); off when ``caching`` is None.

    ``after_reset`` runs after every :meth:`reset`, on or off (virtual mode trims its idle
    pages: those only the cache held are idle now).
    """

    def __init__(self, caching: PrefixCaching | None,
                 after_reset: Callable[[], None] | None = None) -> None:
        #: the machinery, None when prefix caching is off
        self.caching = caching
        self._after_reset = after_reset

    @property
    def enabled(self) -> bool:
        """Whether prefix caching is on (requests may start with cached tokens)."""
        return self.caching is not None

    def match(self, request_id: str, token_ids: Sequence[int],
              cache_salt: str | None = None) -> int:
        """Give a request that holds no KV yet the longest cached prefix of ``token_ids``;
        returns the tokens it now has (0 when prefix caching is off)."""
        if self.caching is None:
            return 0
        return self.caching.match(request_id, token_ids, cache_salt)

    def publish(self, request_id: str, token_ids: Sequence[int], num_computed: int,
                cache_salt: str | None = None) -> None:
        """Publish the request's completely computed units to the cache (no-op if off)."""
        if self.caching is not None:
            self.caching.publish(request_id, token_ids, num_computed, cache_salt)

    def reset(self) -> int:
        """Forget every cached unit; returns how many (0 when prefix caching is off)."""
        dropped = self.caching.reset() if self.caching is not None else 0
        if self._after_reset is not None:
            self._after_reset()
        return dropped

    def stats(self) -> PrefixCacheStats:
        """Lookups and hits (in prompt tokens) since start-up."""
        caching = self.caching
        if caching is None:
            return PrefixCacheStats(enabled=False)
        return PrefixCacheStats(True, caching.queries, caching.hits)

    def close(self) -> None:
        """Prefix caching is off from now on (the manager released the cached memory)."""
        self.caching = None
        self._after_reset = None
