"""Which data-parallel replica a new request goes to: least loaded, sticky by prompt prefix.

Pure bookkeeping (no processes, no clocks), so its rule is tested on its own:

- **key**: ``(cache_salt, the prompt's first PREFIX_KEY_TOKENS token ids)`` (the whole prompt
  when shorter; a text prompt: its first PREFIX_KEY_CHARS characters). Two requests with the
  same key can share prefix-cached KV, but only inside one replica.
- **a key seen before** goes to the replica that had it last, unless that replica is far more
  loaded than the least-loaded one: ``load[owner] > STICKY_FACTOR * least + STICKY_SLACK``
  (load = unfinished sequences the router sent there: waiting + running, ``n`` per request).
  Then it goes to the least-loaded replica, which becomes the key's owner.
- **a new key** goes to the least-loaded replica; ties rotate, so an idle server still spreads
  new prefixes over every replica.
- The key map is a bounded LRU (``max_keys``): a key not seen for a long time is new again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

#: token ids of a prompt's start that make its routing key (a KV block of the default size)
PREFIX_KEY_TOKENS = 16
#: characters of a text prompt's start that make its routing key
PREFIX_KEY_CHARS = 64
#: a key stays on its replica while that replica's load is at most factor * least + slack
STICKY_FACTOR = 2
STICKY_SLACK = 8
#: keys remembered (least recently used forgotten first)
MAX_KEYS = 4096


def prefix_key(prompt: str | Sequence[int], cache_salt: str | None) -> Hashable:
    """The routing key of a prompt: requests with equal keys are sent to one replica."""
    if isinstance(prompt, str):
        return cache_salt, prompt[:PREFIX_KEY_CHARS]
    return cache_salt, tuple(prompt[:PREFIX_KEY_TOKENS])


class Router:
    """Chooses a replica for each request key, given the replicas' current loads."""

    def __init__(self, num_replicas: int, *, max_keys: int = MAX_KEYS,
                 sticky_factor: float = STICKY_FACTOR, sticky_slack: int = STICKY_SLACK
                 ) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be positive, got {num_replicas}")
        if max_keys < 1:
            raise ValueError(f"max_keys must be positive, got {max_keys}")
        self.num_replicas = num_replicas
        self.max_keys = max_keys
        self.sticky_factor = sticky_factor
        self.sticky_slack = sticky_slack
        self.owners: OrderedDict[Hashable, int] = OrderedDict()
        self._next = 0  # where the search for a least-loaded replica starts (ties rotate)

    def choose(self, key: Hashable, loads: Sequence[int]) -> int:
        """The replica for a request with ``key`` (``loads[i]``: replica i's unfinished
        sequences); remembers it as the key's owner."""
        if len(loads) != self.num_replicas:
            raise ValueError(f"expected {self.num_replicas} loads, got {len(loads)}")
        least = self._least_loaded(loads)
        owner = self.owners.get(key)
        if owner is not None and loads[owner] <= self.sticky_factor * loads[least] + \
                self.sticky_slack:
            chosen = owner
        else:
            chosen = least
            self._next = (least + 1) % self.num_replicas
        self.owners[key] = chosen
        self.owners.move_to_end(key)
        if len(self.owners) > self.max_keys:
            self.owners.popitem(last=False)
        return chosen

    def _least_loaded(self, loads: Sequence[int]) -> int:
        order = [(self._next + i) % self.num_replicas for i in range(self.num_replicas)]
        return min(order, key=lambda i: loads[i])
