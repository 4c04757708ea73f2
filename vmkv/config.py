"""Frozen configuration objects; derived run-time values are computed, never written back."""

from __future__ import annotations

from dataclasses import dataclass

LAYOUTS = ("all-layers", "per-layer")

KV_MODES = ("virtual", "paged")
LINEAR_BACKENDS = ("auto", "torch", "onednn")  # vmkv.models.linear
HOST_PAGE_SIZE = {"per-layer": 16 << 10, "all-layers": 64 << 10}


def default_layout(device: str) -> str:
    """The virtual layout used when none is asked for (see :class:`CacheConfig`)."""
    return "per-layer" if device == "cpu" else "all-layers"


@dataclass(frozen=True)
class CacheConfig:
    """How KV memory is organised.

    Attributes:
        kv_mode: "virtual" (contiguous slots, pages mapped on demand) or "paged" (block tables).
        kv_cache_bytes: physical KV budget in bytes (pages or blocks together).
        page_size: virtual mode page size in bytes; None picks the default for the device and
            layout (host: 16 KiB per-layer, 64 KiB all-layers; CUDA: the driver granularity,
            2 MiB on Hopper).
        layout: virtual layout, "all-layers" or "per-layer"; None picks per-layer on the CPU
            (token rows stay contiguous per layer: the all-layers layout puts every token of a
            layer on its own 4 KiB page and decode attention becomes TLB-bound at long
            contexts, see docs/benchmarks.md) and all-layers on CUDA (small effective pages
            from 2 MiB granules).
        block_size: paged mode tokens per block.
        premap_pages: virtual mode pages mapped ahead of need per growth (when free).
        max_idle_bytes: memory kept for reuse when no request needs it (deferred slots and idle
            pool pages each); beyond it, memory goes back to the OS/driver. None keeps all.
        precreate: create every physical page at start-up (CUDA: the hot path only maps).
        enable_prefix_caching: share KV of common prefixes across requests (pages or blocks);
            on by default (its overhead at a 0 % hit rate measured ~1 %, docs/benchmarks.md).
        prefix_cache_hash: "sha256" (default; collision-safe across tenants) or "builtin".
    """

    kv_mode: str = "virtual"
    kv_cache_bytes: int = 1 << 30
    page_size: int | None = None
    layout: str | None = None
    block_size: int = 16
    premap_pages: int = 0
    max_idle_bytes: int | None = None
    precreate: bool = False
    enable_prefix_caching: bool = True
    prefix_cache_hash: str = "sha256"

    def __post_init__(self) -> None:
        if self.kv_mode not in KV_MODES:
            raise ValueError(f"kv_mode must be one of {KV_MODES}, got {self.kv_mode!r}")
        if self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if self.page_size is not None and self.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        if self.layout is not None and self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.premap_pages < 0:
            raise ValueError(f"premap_pages must be >= 0, got {self.premap_pages}")
        if self.prefix_cache_hash not in ("sha256", "builtin"):
            raise ValueError(f"prefix_cache_hash must be 'sha256' or 'builtin', "
                             f"got {self.prefix_cache_hash!r}")
        if self.max_idle_bytes is not None and self.max_idle_bytes < 0:
            raise ValueError(f"max_idle_bytes must be >= 0 or None, got {self.max_idle_bytes}")
