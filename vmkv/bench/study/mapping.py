"""Part 4, map latency hidden: what each page operation costs on this machine (``vmkv bench
vmm``: create, map, first touch, unmap, release per page size), and how much of the mapping a
background mapper thread takes off the step: a decode replayed on a real virtual KV cache
(host pages), every step a fixed amount of compute (a torch matmul, which releases the GIL as
a model's kernels do) while requests grow by one token, with the mapper off (growth maps
inline: the step waits for all of it) and on (the next steps' pages mapped during the compute;
the step waits only for what is left)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from vmkv.bench import vmm
from vmkv.bench.memory import SMOLLM2_135M
from vmkv.bench.study.figure import Figure, Section
from vmkv.bench.study.fmt import num
from vmkv.bench.study.scale import KiB, MiB, Scale
from vmkv.config import CacheConfig
from vmkv.engine.llm_engine import PREMAP_LOOKAHEAD_TOKENS
from vmkv.kv import KVSpec, VirtualLayout, create_kv_cache
from vmkv.memory.mapper import BackgroundMapper

NAME, TITLE = "mapping", "Map latency hidden"
GEOMETRIES = (("per-layer", 16 * KiB), ("all-layers", 64 * KiB))  # the CPU layouts' defaults
PROMPT_TOKENS = 64


def compute(ms: float) -> Callable[[], None]:
    """A callable that keeps the cores busy about ``ms`` in torch (GIL released)."""
    a = torch.randn(384, 384)
    for _ in range(5):  # warm: the first calls are slower
        torch.mm(a, a)
    start = time.perf_counter()
    for _ in range(20):
        torch.mm(a, a)
    each = (time.perf_counter() - start) / 20
    n = max(1, round(ms / 1e3 / each))

    def run() -> None:
        for _ in range(n):
            torch.mm(a, a)

    return run


def replay(layout: str, page: int, *, batch: int, steps: int, compute_ms: float,
           mapper_on: bool) -> dict[str, Any]:
    """Decode ``steps`` steps of ``batch`` requests (``PROMPT_TOKENS`` each at the start) on a
    virtual KV cache; per step the compute, then every request's growth by one token."""
    spec = KVSpec(*SMOLLM2_135M)
    length = PROMPT_TOKENS + steps + PREMAP_LOOKAHEAD_TOKENS
    geometry = VirtualLayout(layout, spec, page, length)
    pages = batch * (geometry.pages_for(length) + 1) * geometry.num_regions
    config = CacheConfig(kv_mode="virtual", kv_layout=layout, page_size=page,
                         kv_cache_memory=pages * page)
    kv = create_kv_cache(config, spec, num_slots=batch, max_model_len=length)
    work = compute(compute_ms)
    mapper = BackgroundMapper(kv.backend) if mapper_on else None  # type: ignore[attr-defined]
    kv.mapping.attach(mapper)
    ids = [f"r{i}" for i in range(batch)]
    stall_us, compute_us = [], []
    try:
        for rid in ids:
            if not kv.allocate(rid, PROMPT_TOKENS):
                raise RuntimeError("the replay's KV budget is too small")
        before = kv.accounting.memory_stats()["map"]["calls"]
        for _ in range(steps):
            if mapper is not None:
                mapper.submit(kv.mapping.units(PREMAP_LOOKAHEAD_TOKENS))
            t0 = time.perf_counter()
            work()
            t1 = time.perf_counter()
            if mapper is not None:
                mapper.wait()
            for rid in ids:
                if not kv.allocate(rid, 1):
                    raise RuntimeError("the replay's KV budget is too small")
            t2 = time.perf_counter()
            compute_us.append((t1 - t0) * 1e6)
            stall_us.append((t2 - t1) * 1e6)
        maps = kv.accounting.memory_stats()["map"]["calls"] - before
        busy = mapper.stats.as_dict()["busy_ms"] if mapper is not None else 0.0
    finally:
        if mapper is not None:
            mapper.close()
        kv.close()
    return {"layout": layout, "page_size": page, "mapper": mapper_on, "batch": batch,
            "steps": steps, "map_calls": maps, "mapper_busy_ms": busy,
            "compute_ms_mean": statistics.fmean(compute_us) / 1e3,
            "stall_ms_total": sum(stall_us) / 1e3, "stall_us_mean": statistics.fmean(stall_us),
            "stall_us_p50": statistics.median(stall_us),
            "stall_us_p99": sorted(stall_us)[min(len(stall_us) - 1, int(0.99 * len(stall_us)))],
            "step_ms_mean": (sum(stall_us) + sum(compute_us)) / len(stall_us) / 1e3,
            "stall_pct_of_step": 100 * sum(stall_us) / (sum(stall_us) + sum(compute_us))}


def tasks(scale: Scale, raw: dict[str, Any]) -> list[tuple[str, Callable[[], None]]]:
    def ops() -> None:
        raw["page_ops"] = vmm.run(scale.vmm_page_sizes, devices=("cpu",),
                                  max_pages=scale.vmm_max_pages)

    def one(layout: str, page: int, on: bool) -> None:
        raw.setdefault("replay", []).append(replay(
            layout, page, batch=scale.replay_batch, steps=scale.replay_steps,
            compute_ms=scale.replay_compute_ms, mapper_on=on))

    return [("page operations", ops)] + [
        (f"replay {layout} {page // KiB}K mapper {'on' if on else 'off'}",
         lambda lay=layout, p=page, on=on: one(lay, p, on))
        for layout, page in GEOMETRIES for on in (False, True)]


def summarise(raw: dict[str, Any], scale: Scale) -> dict[str, Any]:
    hidden = {}
    for layout, page in GEOMETRIES:
        off, on = (next(r for r in raw["replay"] if (r["layout"], r["page_size"], r["mapper"])
                        == (layout, page, m)) for m in (False, True))
        hidden[f"{layout} {page // KiB}K"] = {
            "stall_off_ms": off["stall_ms_total"], "stall_on_ms": on["stall_ms_total"],
            "hidden_pct": 100 * (1 - on["stall_ms_total"] / off["stall_ms_total"])
            if off["stall_ms_total"] else None,
            "stall_off_pct_of_step": off["stall_pct_of_step"],
            "stall_on_pct_of_step": on["stall_pct_of_step"],
            "step_off_ms": off["step_ms_mean"], "step_on_ms": on["step_ms_mean"]}
    return {"hidden": hidden, "lookahead_tokens": PREMAP_LOOKAHEAD_TOKENS,
            "prompt_tokens": PROMPT_TOKENS}


def _draw_ops(rows: list[dict[str, Any]]) -> Callable[[str], None]:
    def draw(path: str) -> None:
        from vmkv.bench.plots import pyplot, save

        ops = ("create", "map", "touch", "unmap", "release")
        fig, ax = pyplot().subplots(figsize=(8, 3.4))
        width = 0.8 / len(rows)
        for i, r in enumerate(rows):
            label = f"{r['device']} {r['page_size'] // KiB}K"
            ax.bar([j + i * width for j in range(len(ops))], [r[f"{op}_p50_us"] for op in ops],
                   width, label=label)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(ops))], ops)
        ax.set(ylabel="µs per page (p50)", yscale="log")
        ax.legend(fontsize=7)
        save(fig, path)

    return draw


def _draw_replay(replays: list[dict[str, Any]]) -> Callable[[str], None]:
    def draw(path: str) -> None:
        from vmkv.bench.plots import pyplot, save

        fig, ax = pyplot().subplots(figsize=(7, 3.2))
        labels = [f"{r['layout']} {r['page_size'] // KiB}K\nmapper "
                  f"{'on' if r['mapper'] else 'off'}" for r in replays]
        ax.bar(range(len(replays)), [r["stall_us_mean"] for r in replays],
               color=["tab:orange" if r["mapper"] else "tab:gray" for r in replays])
        ax.set_xticks(range(len(replays)), labels, fontsize=7)
        ax.set(ylabel="µs the step waits for mapping (mean)")
        save(fig, path)

    return draw


def section(doc: dict[str, Any], study: dict[str, Any]) -> Section:
    raw, s, cmd = doc["raw"], doc["summary"], doc["commands"]
    rows = list(raw["page_ops"]["rows"])
    gpu = study.get("parts", {}).get("gpu", {}).get("summary", {}).get("vmm_rows", [])
    ops = Figure(
        name="mapping-page-ops",
        question="What does each page operation cost on this machine, per page size?",
        columns=["device", "page bytes", "pages", "create µs", "map µs (p50 / p99)",
                 "first touch µs", "unmap µs (p50 / p99)", "release µs"],
        rows=[[r["device"], r["page_size"], r["pages"], r["create_p50_us"],
               f"{num(r['map_p50_us'])} / {num(r['map_p99_us'])}", r["touch_p50_us"],
               f"{num(r['unmap_p50_us'])} / {num(r['unmap_p99_us'])}", r["release_p50_us"]]
              for r in rows + gpu],
        command=cmd["ops"], draw=_draw_ops(rows + gpu),
        notes=["First touch = the page faults of a fresh mapping and the kernel's zero-fill "
               "(host), the first write (CUDA). CUDA rows come from the GPU check when its "
               "results exist (see the GPU section)."])
    replays = raw["replay"]
    replay_fig = Figure(
        name="mapping-stall",
        question="How much of the mapping does a background mapper thread hide from a decode "
                 "step on this machine?",
        columns=["layout, page", "mapper", "map calls", "stall ms (total)", "stall µs mean",
                 "p50", "p99", "stall % of step", "mapper busy ms", "compute ms / step",
                 "step ms"],
        rows=[[f"{r['layout']} {num(r['page_size'])} B", "on" if r["mapper"] else "off",
               r["map_calls"], r["stall_ms_total"], r["stall_us_mean"], r["stall_us_p50"],
               r["stall_us_p99"], r["stall_pct_of_step"], r["mapper_busy_ms"],
               r["compute_ms_mean"], r["step_ms_mean"]] for r in replays],
        command=cmd["replay"], draw=_draw_replay(replays),
        notes=[f"{num(replays[0]['batch'])} requests of {num(s['prompt_tokens'])} tokens grow "
               f"by one token per step for {num(replays[0]['steps'])} steps; the mapper maps "
               f"{num(s['lookahead_tokens'])} tokens ahead (the engine's lookahead)."])
    reading = [f"{k}: the step waits {num(v['stall_off_ms'])} ms in all for mapping with the "
               f"mapper off ({num(v['stall_off_pct_of_step'])} % of the step) and "
               f"{num(v['stall_on_ms'])} ms with it on ({num(v['stall_on_pct_of_step'])} %): "
               f"{num(v['hidden_pct'])} % hidden. A whole step (compute + wait) takes "
               f"{num(v['step_off_ms'])} ms with the mapper off and {num(v['step_on_ms'])} ms "
               "with it on" + (": the mapper thread takes its time from the compute, on the "
                               "same cores." if v["step_on_ms"] > v["step_off_ms"] else ".")
               for k, v in s["hidden"].items()]
    return Section(TITLE, reading, [ops, replay_fig])


def commands(scale: Scale, study: str) -> dict[str, str]:
    pages = ",".join(f"{p // KiB}K" if p < MiB else f"{p // MiB}M" for p in scale.vmm_page_sizes)
    return {"ops": f"{study}  (alone: vmkv bench vmm --page-sizes {pages} --devices cpu)",
            "replay": study}
