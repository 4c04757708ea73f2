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
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence

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


class PrefixCachingMixin:
    """Prefix caching shared by both KV modes; each mode supplies the unit geometry and how a
    unit is referenced (block ids, or one page per region at one page index).

    Hooks a manager implements: ``_unit_span(i) -> (first_token, end_token)`` (tokens
    overlapping unit i), ``_unit_payload(request_id, i)``, ``_hold(payload)`` /
    ``_unhold(payload)`` (one reference per block/page), ``_is_cache_only(payload)``,
    ``_payload_units(payload)`` and ``_adopt(request_id, payloads) -> tokens | None`` (give a new
    request the hit units; None if it cannot, e.g. no free slot).
    """

    prefix: PrefixCache | None = None

    def _init_prefix_cache(self, enabled: bool, hash_name: str) -> None:
        self.prefix = PrefixCache(hash_name) if enabled else None
        self._hashes: dict[str, list[UnitHash]] = {}
        self._registered: dict[str, int] = {}

    def _spans(self) -> Iterable[tuple[int, int]]:
        i = 0
        while True:
            yield self._unit_span(i)
            i += 1

    def match_prefix(self, request_id: str, token_ids: Sequence[int],
                     cache_salt: str | None = None) -> int:
        """Give a request that holds no KV yet the longest cached prefix of ``token_ids``;
        returns the tokens it now has (0: none, or caching is off). The last token is never
        taken from the cache: its logits must be computed."""
        if self.prefix is None:
            return 0
        self._quiesce()  # _adopt maps and unmaps: never beside the background mapper
        extra = (cache_salt or "").encode()
        hashes = unit_hashes(self.prefix.hash, token_ids[: len(token_ids) - 1], self._spans(),
                             extra, [])
        payloads = self.prefix.lookup(hashes)
        tokens = self._adopt(request_id, payloads) if payloads else None
        self.prefix.record(len(token_ids), tokens or 0)
        if tokens:
            self._hashes[request_id] = hashes
            self._registered[request_id] = len(payloads)
        return tokens or 0

    def cache_computed(self, request_id: str, token_ids: Sequence[int], num_computed: int,
                       cache_salt: str | None = None) -> None:
        """Publish the request's units that ``num_computed`` tokens now fill completely."""
        if self.prefix is None:
            return
        self._quiesce()
        done = complete = self._registered.get(request_id, 0)
        while self._unit_span(complete)[1] <= num_computed:
            complete += 1
        if complete == done:
            return
        hashes = self._hashes.setdefault(request_id, [])
        unit_hashes(self.prefix.hash, token_ids[:num_computed], self._spans(),
                    (cache_salt or "").encode(), hashes)
        for i in range(done, complete):
            payload = self._unit_payload(request_id, i)
            if self.prefix.insert(hashes[i], payload):
                self._hold(payload)
        self._registered[request_id] = complete

    def _forget_prefix(self, request_id: str) -> None:
        """On free: the request's units become recently used, deepest first (so the deepest
        ones are evicted first)."""
        hashes = self._hashes.pop(request_id, [])
        registered = self._registered.pop(request_id, 0)
        if self.prefix is not None:
            self.prefix.touch(reversed(hashes[:registered]))

    def _inherit_prefix(self, parent_id: str, child_id: str) -> None:
        if parent_id in self._hashes:
            self._hashes[child_id] = list(self._hashes[parent_id])
            self._registered[child_id] = self._registered.get(parent_id, 0)

    def _evict_cached(self, units_wanted: int) -> int:
        """Evict least recently used cache-only units until ``units_wanted`` are free."""
        freed = 0
        while self.prefix is not None and freed < units_wanted:
            entry = self.prefix.evict(self._is_cache_only)
            if entry is None:
                break
            self._unhold(entry[1])
            freed += self._payload_units(entry[1])
        return freed

    def reset_prefix_cache(self) -> int:
        """Forget every cached unit (vLLM's ``reset_prefix_cache``); returns how many.

        The cache's own references are released: units only the cache held go back to the free
        pool, units that running requests use stay theirs, no longer shared with later requests.
        Hit statistics are kept. Benchmarks call it so that each repetition starts cold.
        """
        if self.prefix is None:
            return 0
        self._quiesce()
        dropped = 0
        while (entry := self.prefix.evict(lambda _payload: True)) is not None:
            self._unhold(entry[1])
            dropped += 1
        return dropped

    def _quiesce(self) -> None:
        """Wait for background work on the manager (virtual mode's mapper); none by default."""

    def _num_evictable(self) -> int:
        if self.prefix is None:
            return 0
        return sum(self._payload_units(p) for p in self.prefix.payloads()
                   if self._is_cache_only(p))

    def _cache_holds(self) -> list[object]:
        return list(self.prefix.payloads()) if self.prefix is not None else []
