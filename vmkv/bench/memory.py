"""``vmkv bench memory``: the useful fraction of KV memory per allocation strategy.

For a set of final request lengths, each strategy holds some memory; the useful fraction is the
part that stores live tokens' K/V. Paged and virtual figures come from the real managers (real
blocks; real pages mapped on the host backend), not from a formula:

    naive     every request reserves max_len tokens up front (pre-paging servers)
    paged     blocks of block_size tokens (PagedAttention)
    virtual   pages of page_size bytes under contiguous slots, per layout (vAttention)
"""

from __future__ import annotations

from typing import Any

import torch

from vmkv.config import CacheConfig
from vmkv.kv import KVCacheManager, KVSpec, KVUsage, create_kv_cache
from vmkv.kv.spec import LAYOUTS, VirtualLayout

SEED_LENGTHS = (37, 512, 128, 64, 900, 41, 1503, 72)  # the seed's example
#: KV shape of the default model, SmolLM2-135M (30 layers, 3 KV heads of 64)
SMOLLM2_135M = (30, 3, 64)


def naive_fraction(lengths: list[int], max_len: int) -> float:
    return sum(lengths) / (max_len * len(lengths))


def paged_fraction(lengths: list[int], spec: KVSpec, block_size: int) -> dict[str, Any]:
    blocks = sum(-(-n // block_size) for n in lengths)
    config = CacheConfig(kv_mode="paged", kv_cache_memory=blocks * block_size *
                         spec.bytes_per_token, block_size=block_size, enable_prefix_caching=False)
    kv = create_kv_cache(config, spec, num_slots=len(lengths), max_model_len=max(lengths))
    try:
        usage = _fill(kv, lengths)
        return {"bytes_in_use": usage.bytes_in_use, "useful_fraction": usage.useful_fraction}
    finally:
        kv.close()


def virtual_fraction(lengths: list[int], spec: KVSpec, page_size: int, layout: str
                     ) -> dict[str, Any]:
    geometry = VirtualLayout(layout, spec, page_size, max(lengths))
    pages = sum(geometry.pages_for(n) for n in lengths) * geometry.num_regions
    config = CacheConfig(kv_mode="virtual", kv_cache_memory=pages * page_size,
                         page_size=page_size, kv_layout=layout, enable_prefix_caching=False)
    kv = create_kv_cache(config, spec, num_slots=len(lengths), max_model_len=max(lengths))
    try:
        usage = _fill(kv, lengths)
        return {
            "bytes_in_use": usage.bytes_in_use,
            "useful_fraction": usage.useful_fraction,
            "tokens_per_page": page_size / geometry.row_bytes,
            "maps": kv.accounting.memory_stats()["map"]["calls"],
        }
    finally:
        kv.close()


def _fill(kv: KVCacheManager, lengths: list[int]) -> KVUsage:
    for i, n in enumerate(lengths):
        if not kv.allocate(f"r{i}", n):
            raise AssertionError("the pool was sized to fit exactly")
    return kv.accounting.usage


def run(lengths: list[int], *, max_len: int = 2048, block_size: int = 16,
        page_sizes: tuple[int, ...] = (64 * 1024, 2 << 20), layouts: tuple[str, ...] = LAYOUTS,
        shape: tuple[int, int, int] = SMOLLM2_135M, dtype: torch.dtype = torch.float32
        ) -> dict[str, Any]:
    """Measure every strategy on ``lengths``; returns rows for a table and the JSON file."""
    if not lengths or min(lengths) <= 0:
        raise ValueError(f"lengths must be positive integers, got {lengths}")
    if max(lengths) > max_len:
        raise ValueError(f"a length ({max(lengths)}) exceeds max_len ({max_len})")
    spec = KVSpec(*shape, dtype=dtype)
    used = sum(lengths) * spec.bytes_per_token
    rows: list[dict[str, Any]] = [{
        "strategy": "naive", "setting": f"max_len {max_len}",
        "bytes_in_use": max_len * len(lengths) * spec.bytes_per_token,
        "useful_fraction": naive_fraction(lengths, max_len),
    }]
    rows.append({"strategy": "paged", "setting": f"block {block_size}",
                 **paged_fraction(lengths, spec, block_size)})
    for page in page_sizes:
        for layout in layouts:
            rows.append({"strategy": "virtual", "setting": f"{layout}, page {page // 1024} KiB",
                         **virtual_fraction(lengths, spec, page, layout)})
    for row in rows:
        row["useful_pct"] = 100 * row["useful_fraction"]
    return {
        "lengths": lengths,
        "kv_shape": {"layers": shape[0], "kv_heads": shape[1], "head_dim": shape[2],
                     "dtype": str(dtype).removeprefix("torch."),
                     "bytes_per_token": spec.bytes_per_token},
        "useful_bytes": used,
        "rows": rows,
    }


COLUMNS = ("strategy", "setting", "useful_pct", "bytes_in_use", "tokens_per_page", "maps")
