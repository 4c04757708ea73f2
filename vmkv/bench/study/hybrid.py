"""Part 7, hybrid models: what sliding-window layers cost in memory when their pages or blocks
behind the window go back, against a uniform layout of the same model (every layer keeping
every token), on the real managers with Gemma 3 270M's KV shapes (18 layers, 15 of them
sliding with a window of 512; 1 KV head of 256; bfloat16: 18,432 B per token):

    life       one request prefilled in 512-token chunks to N tokens, then decoding: resident
               KV by layer group after every step, the pool file's bytes as the OS counts them
               (virtual: ``st_blocks`` of the memfd), map / unmap calls per token while the
               window slides, the virtual address the slot spans
    capacity   how many N-token requests a fixed KV budget holds at once (each grown in
               512-token chunks until the managers refuse)

Both KV modes: virtual (per-layer layout, 16 KiB pages, pages created on demand and released
when idle) and paged (128-token blocks, the CPU default).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from vmkv.bench.study.figure import Figure, Section
from vmkv.bench.study.fmt import num
from vmkv.bench.study.scale import KiB, MiB, Scale
from vmkv.config import CacheConfig
from vmkv.kv import KVCacheManager, create_kv_cache
from vmkv.kv.spec import KVSpec, LayerGroup

NAME, TITLE = "hybrid", "Hybrid models (sliding-window layers)"
MODES = ("virtual", "paged")
LAYOUTS = ("grouped", "uniform")
WINDOW, CHUNK, DECODE = 512, 512, 64
MODEL = ("Gemma 3 270M's KV: 18 layers, 15 of them sliding (window 512) and 3 full, 1 KV head "
         "of 256, bfloat16")
#: the issue's targets: resident KV at most 0.25x the uniform layout's, 3x the requests at once
TARGETS = {"resident_ratio": 0.25, "capacity_ratio": 3}
#: (request length N, KV budget of the capacity runs) per scale
SIZES = {"full": (8192, 1024 * MiB), "quick": (8192, 512 * MiB), "smoke": (1536, 48 * MiB)}


def gemma3_270m_spec(grouped: bool) -> KVSpec:
    """Gemma 3 270M's KV in bfloat16; ``grouped``: its layer groups (window 512 on every layer
    but 5, 11, 17), else one full-attention group (the uniform layout)."""
    full = (5, 11, 17)
    groups = (LayerGroup(full), LayerGroup(tuple(i for i in range(18) if i not in full),
                                           WINDOW)) if grouped else ()
    return KVSpec(18, 1, 256, torch.bfloat16, groups)


def manager(mode: str, grouped: bool, budget: int, max_len: int, slots: int) -> KVCacheManager:
    config = CacheConfig(kv_mode=mode, kv_cache_memory=budget, kv_layout="per-layer",
                         page_size=16 * KiB, block_size=128, max_idle_memory=0,
                         enable_prefix_caching=False, precreate=False)
    return create_kv_cache(config, gemma3_270m_spec(grouped), num_slots=slots,
                           max_model_len=max_len)


def resident(kv: Any) -> dict[str, int]:
    """Bytes the request's memory holds, full-attention layers and sliding ones apart."""
    if kv.kv_mode == "virtual":
        (slot,) = kv.slots.slot_of.values() or (0,)
        ps, regions, keep = kv.pool.page_size, len(kv.regions), kv.regions.keep
        mapped, dropped = kv.slots.mapped[slot], kv.slots.dropped[slot]
        return {"full": mapped * keep * ps, "sliding": (mapped - dropped) * (regions - keep) * ps,
                "os": kv.backend.allocated_bytes(), "va": mapped * regions * ps}
    state = kv.changes
    block = state.block_size * 2 * state.lanes * state.spec.head_bytes
    out = {"full": 0, "sliding": 0}
    for tables, (_, window) in zip(state.group_tables, state.groups, strict=True):
        live = sum(1 for t in tables.values() for b in t if b >= 0)
        out["sliding" if window else "full"] += live * block
    return out


def life(mode: str, grouped: bool, length: int) -> dict[str, Any]:
    """One request to ``length`` tokens and ``DECODE`` more: resident bytes after each step,
    map and unmap calls while decoding."""
    spec = gemma3_270m_spec(grouped)
    kv = manager(mode, grouped, (length + 2 * DECODE) * spec.bytes_per_token + 64 * MiB,
                 length + DECODE, 2)
    rows, t0 = [], time.perf_counter()
    tokens = 0
    while tokens < length:
        n = min(CHUNK, length - tokens)
        assert kv.allocate("r", n), f"{mode}: no room at {tokens} tokens"
        tokens += n
        rows.append({"tokens": tokens, **resident(kv)})
    stats = kv.accounting.memory_stats()
    before = {op: stats.get(op, {}).get("calls", 0) for op in ("map", "unmap")}
    for _ in range(DECODE):
        assert kv.allocate("r", 1)
        tokens += 1
        rows.append({"tokens": tokens, **resident(kv)})
    stats = kv.accounting.memory_stats()
    calls = {op: stats.get(op, {}).get("calls", 0) - before[op] for op in ("map", "unmap")}
    kv.accounting.check()
    kv.free("r")
    kv.close()
    return {"rows": rows, "decode_calls_per_token": {k: v / DECODE for k, v in calls.items()},
            "seconds": time.perf_counter() - t0}


def capacity(mode: str, grouped: bool, length: int, budget: int) -> dict[str, Any]:
    """How many ``length``-token requests ``budget`` holds at once (grown in chunks)."""
    kv = manager(mode, grouped, budget, length, 256)
    held = 0
    while held < 256:
        rid, tokens = f"r{held}", 0
        while tokens < length and kv.allocate(rid, min(CHUNK, length - tokens)):
            tokens += min(CHUNK, length - tokens)
        if tokens < length:
            break
        held += 1
    kv.accounting.check()
    kv.close()
    return {"requests": held, "budget": budget}


def tasks(scale: Scale, raw: dict[str, Any]) -> list[tuple[str, Callable[[], None]]]:
    length, budget = SIZES[scale.name]
    raw.update(model=MODEL, length=length, budget=budget, window=WINDOW, chunk=CHUNK,
               decode=DECODE, life={}, capacity={})

    def one(mode: str, layout: str) -> None:
        key = f"{mode}/{layout}"
        raw["life"][key] = life(mode, layout == "grouped", length)
        raw["capacity"][key] = capacity(mode, layout == "grouped", length, budget)

    return [(f"{m} {lay}", lambda m=m, lay=lay: one(m, lay)) for m in MODES for lay in LAYOUTS]


def summarise(raw: dict[str, Any], scale: Scale) -> dict[str, Any]:
    out: dict[str, Any] = {"targets": TARGETS, "modes": {}}
    for mode in MODES:
        grouped, uniform = (raw["life"][f"{mode}/{lay}"] for lay in LAYOUTS)
        # decoding at N tokens (the window and one token), and right after the last chunk
        at = {lay: next(r for r in run["rows"] if r["tokens"] == raw["length"] + 1)
              for lay, run in zip(LAYOUTS, (grouped, uniform), strict=True)}
        chunk = {lay: next(r for r in run["rows"] if r["tokens"] == raw["length"])
                 for lay, run in zip(LAYOUTS, (grouped, uniform), strict=True)}
        kv = {lay: at[lay]["full"] + at[lay]["sliding"] for lay in LAYOUTS}
        after_chunk = {lay: chunk[lay]["full"] + chunk[lay]["sliding"] for lay in LAYOUTS}
        caps = {lay: raw["capacity"][f"{mode}/{lay}"]["requests"] for lay in LAYOUTS}
        out["modes"][mode] = {
            "resident_grouped": kv["grouped"], "resident_uniform": kv["uniform"],
            "resident_ratio": kv["grouped"] / kv["uniform"],
            "after_chunk_ratio": after_chunk["grouped"] / after_chunk["uniform"],
            "os_ratio": (at["grouped"]["os"] / at["uniform"]["os"]
                         if "os" in at["grouped"] else None),
            "requests_grouped": caps["grouped"], "requests_uniform": caps["uniform"],
            "capacity_ratio": caps["grouped"] / max(1, caps["uniform"]),
            "decode_calls_per_token": grouped["decode_calls_per_token"],
        }
    return out


def _draw(raw: dict[str, Any]) -> Callable[[str], None]:
    def draw(path: str) -> None:
        from vmkv.bench.plots import pyplot, save

        fig, axes = pyplot().subplots(1, 2, figsize=(11, 3.8))
        for ax, mode in zip(axes, MODES, strict=True):
            for lay in LAYOUTS:
                rows = raw["life"][f"{mode}/{lay}"]["rows"]
                x = np.array([r["tokens"] for r in rows])
                for part, style in (("full", "-"), ("sliding", "--")):
                    ax.plot(x, np.array([r[part] for r in rows]) / MiB, style,
                            label=f"{lay}: {part} layers")
            ax.set(xlabel="tokens of the request", ylabel="resident KV (MiB)", title=mode)
            ax.legend(fontsize="small")
        save(fig, path)

    return draw


def section(doc: dict[str, Any], study: dict[str, Any]) -> Section:
    raw, s, cmd = doc["raw"], doc["summary"], doc["commands"]
    n = num(raw["length"])
    resident_fig = Figure(
        name="hybrid-resident",
        question=f"How much KV does one {n}-token request keep resident when the sliding "
                 "layers give back what falls behind the window, against every layer keeping "
                 "every token?",
        columns=["mode", "grouped (bytes)", "uniform (bytes)", "ratio", "OS ratio (memfd)",
                 "ratio after the last chunk", "decode map calls/token",
                 "decode unmap calls/token"],
        rows=[[m, v["resident_grouped"], v["resident_uniform"], v["resident_ratio"],
               v["os_ratio"], v["after_chunk_ratio"], v["decode_calls_per_token"]["map"],
               v["decode_calls_per_token"]["unmap"]] for m, v in s["modes"].items()],
        command=cmd["life"], draw=_draw(raw),
        notes=[f"{raw['model']}. Prefilled in {num(raw['chunk'])}-token chunks, then "
               f"{num(raw['decode'])} decode steps; resident KV while decoding at {n} tokens "
               "(the sliding layers hold the window and the step), and right after the last "
               "chunk (they hold the window and the chunk); the target is a ratio of at most "
               f"{num(s['targets']['resident_ratio'])} (the issue's)."])
    capacity_fig = Figure(
        name="hybrid-capacity",
        question=f"How many {n}-token requests fit in {num(raw['budget'])} bytes of KV at once?",
        columns=["mode", "grouped", "uniform", "ratio"],
        rows=[[m, v["requests_grouped"], v["requests_uniform"], v["capacity_ratio"]]
              for m, v in s["modes"].items()],
        command=cmd["capacity"], draw=None,
        notes=["Each request grown in chunks until the manager refuses; the target is a ratio "
               f"of at least {num(s['targets']['capacity_ratio'])}."])
    reading = [f"{m}: {num(v['resident_ratio'])}x the uniform layout's resident KV, "
               f"{num(v['capacity_ratio'])}x the requests at once."
               for m, v in s["modes"].items()]
    return Section(TITLE, reading, [resident_fig, capacity_fig])


def commands(scale: Scale, study: str) -> dict[str, str]:
    return {"life": study, "capacity": study}
