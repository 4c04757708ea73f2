"""What keeps the tensor-parallel ranks' KV managers in agreement besides the changes they
apply (vmkv/kv/changes.py): one VMA budget for all, and, in the debug mode
(``--tp-check``), a digest of each manager compared after every step.

The managers of all ranks have the same geometry (same page/block counts, same slot count;
only the bytes per token differ), so rank 0's slot ids, page ids and block ids mean the same on
every rank; a worker applies rank 0's changes and decides nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import fields

import numpy as np

from vmkv.distributed.collectives import agree_min
from vmkv.kv.base import KVCacheManager


class KVDivergedError(RuntimeError):
    """A worker's KV manager differs from rank 0's."""


def kv_digest(kv: KVCacheManager) -> str:
    """A hash of what the kernels read and where it lives: every request's token count, rows
    (slot ids or block table) and physical units (pages or blocks). Not the usage: the OS's
    counts of a rank's memory, huge pages for one, may differ where the decisions do not."""
    ids = sorted(kv.room.request_ids())
    h = hashlib.sha256(repr((ids, [kv.room.num_tokens(r) for r in ids],
                             [kv.room.units_of(r) for r in ids])).encode())
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
    """Every rank's manager takes the smallest VMA budget of all ranks (a per-process quantity:
    rank 0 must not choose a mapping another rank's budget refuses). A collective on the
    control group: also the ranks' "ready" barrier."""
    budget = agree_min(kv.accounting.vma_budget or NO_BUDGET, timeout, alive)
    if budget < NO_BUDGET:
        kv.accounting.limit_vma_budget(budget)
