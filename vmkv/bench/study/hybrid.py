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
    long       the model itself (gemma-3-270m) serving a long-context mix (prompts of
               2,000-8,000 tokens) in a fixed KV budget: virtual grouped (per-layer layout),
               virtual uniform (the all-layers layout: windows applied by the kernel, no
               memory given back) and paged grouped, alternated; throughput and the virtual
               tax (map/unmap calls, page creation, first touch) as part 3 decomposes it

Both KV modes: virtual (per-layer layout, 16 KiB pages, pages created on demand and released
when idle) and paged (128-token blocks, the CPU default).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from vmkv.bench import vmm
from vmkv.bench.study import runs, tax
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
#: the long-context runs per scale: (requests, prompt range, output range, KV budget)
LONG = {"full": (16, (2000, 8000), (32, 128), 1024 * MiB),
        "quick": (8, (1000, 4000), (16, 64), 512 * MiB),
        "smoke": (2, (600, 700), (4, 8), 64 * MiB)}
#: the long-context engines: name -> EngineConfig fields (bfloat16 where the CPU has it)
LONG_ENGINES = {"virtual grouped": {"kv_mode": "virtual", "kv_layout": "per-layer"},
                "virtual uniform": {"kv_mode": "virtual", "kv_layout": "all-layers"},
                "paged grouped": {"kv_mode": "paged"}}


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

    return [*((f"{m} {lay}", lambda m=m, lay=lay: one(m, lay)) for m in MODES for lay in LAYOUTS),
            ("gemma-3-270m, long context", lambda: long_context(scale, raw))]


def long_context(scale: Scale, raw: dict[str, Any]) -> None:
    """The model on the long-context mix, :data:`LONG_ENGINES` alternated (``raw["long"]``)."""
    from vmkv.bench.common import workload_for_model
    from vmkv.bench.workloads import WorkloadSpec

    n, prompt, output, budget = LONG[scale.name]
    spec = WorkloadSpec("random", num_prompts=n, input_len=prompt, output_len=output,
                        seed=runs.SEED)
    requests, info = workload_for_model(spec, "gemma-3-270m")
    configs = {name: runs.engine_config(scale, model="gemma-3-270m", dtype="auto",
                                        kv_cache_memory=budget, **fields)
               for name, fields in LONG_ENGINES.items()}
    out: dict[str, Any] = {"workload": {**info, "mix": "long-context"}, "budget": budget}
    with runs.built(configs) as made:
        out["startup"] = made["startup"]
        out["page_size"] = {name: (e.kv.pool.page_size if e.kv.kv_mode == "virtual" else None)
                            for name, e in made["engines"].items()}
        out["runs"] = runs.alternate(made["engines"], requests, repeats=scale.repeats,
                                     warmup=runs.warmup_requests(requests, 1))
    sizes = sorted({p for p in out["page_size"].values() if p})
    out["page_ops"] = vmm.run(tuple(sizes), devices=("cpu",), max_pages=64)
    raw["long"] = out


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
    if "long" in raw:
        out["long"] = summarise_long(raw["long"])
    return out


def summarise_long(long: dict[str, Any]) -> dict[str, Any]:
    """Per engine of the long-context runs: medians of throughput and of the virtual tax
    (:func:`.tax.run_numbers`), run time against paged's, repetition by repetition."""
    touch_us = {r["page_size"]: r["touch_p50_us"] for r in long["page_ops"]["rows"]}
    elapsed = {(r["mode"], r["repeat"]): r["elapsed_s"] for r in long["runs"]}
    engines: dict[str, Any] = {}
    for name, page in long["page_size"].items():
        numbers = [tax.run_numbers(r, page, touch_us) for r in long["runs"] if r["mode"] == name]
        med = {k: statistics.median(x[k] for x in numbers) for k in numbers[0]
               if k != "tlb_misses_per_step"}
        med["engine_init_s"] = long["startup"][name]["engine_init_s"]
        med["time_vs_paged_pct"] = statistics.median(
            100 * (elapsed[(name, rep)] / elapsed[("paged grouped", rep)] - 1)
            for (mode, rep) in elapsed if mode == name)
        engines[name] = med
    tps = {n: v["output_tokens_per_s"] for n, v in engines.items()}
    return {"engines": engines,
            "virtual_over_paged": tps["virtual grouped"] / tps["paged grouped"],
            "grouped_over_uniform": tps["virtual grouped"] / tps["virtual uniform"]}


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
    figures = [resident_fig, capacity_fig]
    if "long" in s:
        figures.append(_long_figure(raw["long"], s["long"], cmd["long"]))
        lo = s["long"]
        reading.append(f"gemma-3-270m on long prompts: virtual grouped / paged output tokens/s "
                       f"{num(lo['virtual_over_paged'])}, grouped / uniform "
                       f"{num(lo['grouped_over_uniform'])} (virtual); the virtual tax "
                       f"{num(lo['engines']['virtual grouped']['tax_pct'])} % of the run.")
    return Section(TITLE, reading, figures)


def _long_figure(long: dict[str, Any], s: dict[str, Any], command: str) -> Figure:
    w = long["workload"]
    return Figure(
        name="hybrid-long-context",
        question="Serving the model itself on long prompts in a fixed KV budget: what does "
                 "giving back memory behind the window buy, and what does virtual mode pay for "
                 "it (the virtual tax as part 3 decomposes it)?",
        columns=["engine", "out tok/s", "step ms", "map+unmap calls", "map+unmap ms",
                 "pages created", "create+release ms", "first touch ms (est.)", "tax % of run",
                 "run time vs paged grouped %", "engine start s"],
        rows=[[n, v["output_tokens_per_s"], v["step_ms"], v["map_calls"], v["map_ms"],
               v["pages_created"], v["create_ms"], v["first_touch_ms"], v["tax_pct"],
               v["time_vs_paged_pct"], v["engine_init_s"]] for n, v in s["engines"].items()],
        command=command, draw=None,
        notes=[f"gemma-3-270m (the GGUF dequantized, bfloat16 where the CPU has it), "
               f"{num(w['num_requests'])} requests of random tokens ({num(w['input_tokens'])} "
               f"prompt, {num(w['output_tokens'])} output tokens), a KV budget of "
               f"{num(long['budget'])} bytes, medians of alternated repetitions. Uniform is the "
               "all-layers layout: one page holds every layer's tokens, so the kernel applies "
               "the windows and nothing goes back."])


def commands(scale: Scale, study: str) -> dict[str, str]:
    n, prompt, output, budget = LONG[scale.name]
    one = (f"{study}  (one engine alone: vmkv bench throughput --model gemma-3-270m "
           f"--kv-mode virtual|paged --kv-layout per-layer|all-layers --input-len "
           f"{prompt[0]}:{prompt[1]} --output-len {output[0]}:{output[1]} --num-prompts {n} "
           f"--kv-cache-memory {budget})")
    return {"life": study, "capacity": study, "long": one}
