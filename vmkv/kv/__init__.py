"""KV cache managers: virtual (vAttention) and paged (PagedAttention) behind one interface."""

from __future__ import annotations

import logging

from vmkv.config import CPU_GROWTH_TOKENS, HOST_PAGE_SIZE, CacheConfig, default_layout
from vmkv.kv.base import KVCacheManager, KVUsage
from vmkv.kv.paged import PagedKVCache
from vmkv.kv.paged.blocks import block_groups
from vmkv.kv.spec import LAYOUTS, KVSpec, VirtualLayout
from vmkv.kv.virtual import VirtualKVCache

logger = logging.getLogger("vmkv")

#: pages a pool that is not pre-created creates at once (one host ``fallocate`` for 16 pages of
#: one region's partition instead of 16): a cold run of the vLLM workload made 54,000
#: one-page calls (196 ms) otherwise; the extra pages wait idle, at most 16 per region
CREATE_CHUNK = 16
#: share of a pre-created host pool spread over the idle slots at start-up, mapped and populated
#: (``VirtualKVCache.warm_idle_slots``), so requests start without map calls or first-access
#: faults as paged mode's pre-zeroed tensor does; the other half stays free for growth
WARM_SLOTS_SHARE = 0.5

__all__ = [
    "LAYOUTS",
    "KVCacheManager",
    "KVSpec",
    "KVUsage",
    "PagedKVCache",
    "VirtualKVCache",
    "VirtualLayout",
    "create_kv_cache",
]


def prefix_caching(config: CacheConfig, spec: KVSpec, gives_back: int) -> bool:
    """Whether the manager caches prefixes: as configured, except where sliding-window layers
    give their pages or blocks back (``gives_back``): off then, said in one log line."""
    if config.enable_prefix_caching and gives_back:
        logger.warning("prefix caching off: the sliding-window layers (window %d) give back "
                       "their KV behind the window, so a cached prefix would lack it",
                       max(spec.windows))
        return False
    return config.enable_prefix_caching


def create_kv_cache(
    config: CacheConfig, spec: KVSpec, *, num_slots: int, max_model_len: int, device: str = "cpu"
) -> KVCacheManager:
    """Build the manager ``config.kv_mode`` asks for, with its backend and physical budget.

    Raises ValueError when the budget holds less than one page or block, or the page size does
    not suit the backend.
    """
    if config.kv_mode == "paged":
        # a block holds block_size tokens of one block group's layers (all of them without
        # sliding-window layers)
        lanes = len(block_groups(spec)[0][0])
        block_bytes = config.block_size * 2 * lanes * spec.head_bytes
        num_blocks = config.kv_cache_memory // block_bytes
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory ({config.kv_cache_memory}) holds no block of "
                             f"{block_bytes} B")
        return PagedKVCache(spec, num_blocks=num_blocks, block_size=config.block_size,
                            max_model_len=max_model_len, device=device,
                            enable_prefix_caching=prefix_caching(config, spec, max(spec.windows)),
                            prefix_cache_hash=config.prefix_cache_hash)

    from vmkv.memory import PagePool, create_backend, default_vma_budget

    layout_name = config.kv_layout or default_layout(device)
    requested = config.page_size
    if requested is None and device == "cpu":
        requested = HOST_PAGE_SIZE[layout_name]
    probe = create_backend(device, requested, 1)  # validates and resolves the page size
    page_size = probe.page_size
    probe.close()
    num_pages = config.kv_cache_memory // page_size
    layout = VirtualLayout(layout_name, spec, page_size, max_model_len)
    if num_pages < layout.num_regions:
        raise ValueError(f"kv_cache_memory ({config.kv_cache_memory}) holds fewer than one page "
                         f"of {page_size} B per region ({layout.num_regions} regions)")
    backend = create_backend(device, page_size, num_pages)
    idle_pages = None if config.max_idle_memory is None else config.max_idle_memory // page_size
    pool = PagePool(
        backend,
        num_pages,
        precreate=num_pages if config.precreate else 0,
        max_idle_pages=idle_pages,
        max_vmas=default_vma_budget(backend),
        # one per region: lockstep growth, adjacent pages; one for all where sliding-window
        # regions give their pages back (the full regions take them: a shared budget)
        partitions=1 if layout.drop_window else layout.num_regions,
        create_chunk=1 if config.precreate else CREATE_CHUNK,
    )
    premap = config.premap_pages
    if premap is None:  # the CPU: a growth maps CPU_GROWTH_TOKENS; CUDA: its mapper maps ahead
        premap = max(0, layout.pages_for(CPU_GROWTH_TOKENS) - 1) if device == "cpu" else 0
    kv = VirtualKVCache(spec, pool=pool, num_slots=num_slots, max_model_len=max_model_len,
                        layout=layout_name, premap_pages=premap, max_idle_pages=idle_pages,
                        enable_prefix_caching=prefix_caching(config, spec, layout.drop_window),
                        prefix_cache_hash=config.prefix_cache_hash)
    if config.precreate and device == "cpu" and idle_pages is None:
        kv.warm_idle_slots(WARM_SLOTS_SHARE)
    return kv
