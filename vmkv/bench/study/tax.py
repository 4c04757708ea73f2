"""Part 3, the virtual tax on this machine: what virtual mode pays that paged mode does not
(map and unmap calls, page creation, first touch of fresh pages: page faults and the kernel's
zero-fill), per page size and layout, with and without pre-mapping and a pre-created pool
(pages on demand), each as a share of the step; beside it one decode and one prefill step split
into parts (``vmkv bench profile``) in both modes.

Every variant is an engine of its own, all run alternately on the same requests
(:func:`~vmkv.bench.study.runs.alternate`), with the process's page faults and, where the
counters are readable, TLB misses around each run. The first touch of pages created during a
run is estimated as pages created x the first-touch time of one page of that size
(``vmkv bench vmm``, measured in the same part)."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from vmkv.bench import profile, vmm
from vmkv.bench.study import runs
from vmkv.bench.study.counters import tlb_readable
from vmkv.bench.study.figure import Figure, Section
from vmkv.bench.study.fmt import num
from vmkv.bench.study.scale import TAX_VARIANTS, Scale
from vmkv.config import HOST_PAGE_SIZE, default_layout

NAME, TITLE = "tax", "The virtual tax"
MAPPER_ON_CPU = ("CPU engines run no background mapper: the host has nothing that computes "
                 "while the engine thread maps (the step runs on the same cores), so "
                 "the KV manager's mapping.start() returns None there; part 4 measures "
                 "what a mapper thread hides on this machine, on a replayed decode.")


def page_size(fields: dict[str, Any]) -> int | None:
    """The virtual page size an engine with these fields uses on the CPU (None: paged)."""
    if fields.get("kv_mode") == "paged":
        return None
    return fields.get("page_size") or HOST_PAGE_SIZE[fields.get("kv_layout")
                                                      or default_layout("cpu")]


def tasks(scale: Scale, raw: dict[str, Any]) -> list[tuple[str, Callable[[], None]]]:
    def touch() -> None:
        sizes = sorted({p for v in scale.tax_variants
                        if (p := page_size(TAX_VARIANTS[v])) is not None})
        raw["page_ops"] = vmm.run(tuple(sizes), devices=("cpu",), max_pages=64)

    def engines() -> None:
        requests, raw["workload"] = runs.mix_workload(scale, scale.tax_mix)
        configs = {v: runs.engine_config(scale, kv_cache_memory=scale.tax_kv_cache_memory,
                                         **TAX_VARIANTS[v]) for v in scale.tax_variants}
        raw["variants"] = {v: {"fields": TAX_VARIANTS[v], "page_size": page_size(
            TAX_VARIANTS[v])} for v in scale.tax_variants}
        with runs.built(configs) as made:
            raw["startup"] = made["startup"]
            for v, engine in made["engines"].items():  # as resolved for this model and dtype
                raw["variants"][v]["premap_pages"] = getattr(engine.kv, "premap_pages",
                                                             None)
            raw["runs"] = runs.alternate(made["engines"], requests, repeats=scale.repeats,
                                         warmup=runs.warmup_requests(requests,
                                                                     scale.warmup_prompts))

    def step_parts(mode: str) -> None:
        prefill_batch, prefill_len = scale.profile_prefill
        result = profile.run(runs.engine_config(scale, kv_mode=mode), batch=scale.profile_batch,
                             context=scale.profile_context, prefill_batch=prefill_batch,
                             prefill_len=prefill_len, repeats=scale.profile_repeats,
                             warmup=1)
        raw.setdefault("profile", {})[mode] = result

    return [("first touch per page size", touch), ("engines, alternated", engines),
            ("profile virtual", lambda: step_parts("virtual")),
            ("profile paged", lambda: step_parts("paged"))]


def op_totals(run: dict[str, Any], *ops: str) -> dict[str, float]:
    found = [run["map_ops"][op] for op in ops if op in run["map_ops"]]
    return {"calls": sum(o["calls"] for o in found), "pages": sum(o["pages"] for o in found),
            "ms": sum(o["total_ns"] for o in found) / 1e6}


def run_numbers(run: dict[str, Any], page: int | None, touch_us: dict[int, float]
                ) -> dict[str, Any]:
    """One run's tax: per step and as a share of the run's time."""
    wall_ms = run["elapsed_s"] * 1e3
    maps, creates = op_totals(run, "map", "unmap"), op_totals(run, "create", "release")
    created = run["map_ops"].get("create", {}).get("pages", 0)
    touch_ms = created * touch_us[page] / 1e3 if page else 0.0
    return {
        "output_tokens_per_s": run["output_tokens_per_s"], "steps": run["steps"],
        "step_ms": wall_ms / run["steps"], "map_calls": maps["calls"], "map_ms": maps["ms"],
        "pages_created": created, "bytes_created": created * (page or 0),
        "create_ms": creates["ms"], "first_touch_ms": touch_ms,
        "minor_faults": run["minor_faults"],
        "minor_faults_per_step": run["minor_faults"] / run["steps"],
        "tlb_misses_per_step": ({e: n / run["steps"] for e, n in run["tlb"].items()
                                 if isinstance(n, int)} if run["tlb"] else None),
        "map_pct": 100 * maps["ms"] / wall_ms, "create_pct": 100 * creates["ms"] / wall_ms,
        "first_touch_pct": 100 * touch_ms / wall_ms,
        "tax_pct": 100 * (maps["ms"] + creates["ms"] + touch_ms) / wall_ms,
    }


def summarise(raw: dict[str, Any], scale: Scale) -> dict[str, Any]:
    touch_us = {r["page_size"]: r["touch_p50_us"] for r in raw["page_ops"]["rows"]}
    per: dict[str, list[dict[str, Any]]] = {}
    for run in raw["runs"]:
        page = raw["variants"][run["mode"]]["page_size"]
        per.setdefault(run["mode"], []).append(run_numbers(run, page, touch_us))
    paged = {r["repeat"]: r["elapsed_s"] for r in raw["runs"] if r["mode"] == "paged"}
    variants: dict[str, Any] = {}
    for name, numbers in per.items():
        med = {k: statistics.median(n[k] for n in numbers) for k in numbers[0]
               if k != "tlb_misses_per_step"}
        med["tlb_misses_per_step"] = numbers[0]["tlb_misses_per_step"]  # first repetition
        med["engine_init_s"] = raw["startup"][name]["engine_init_s"]
        times = {r["repeat"]: r["elapsed_s"] for r in raw["runs"] if r["mode"] == name}
        if paged and name != "paged":
            med["time_vs_paged_pct"] = statistics.median(
                100 * (times[i] / paged[i] - 1) for i in times)
            med["time_vs_paged_abs_pct"] = abs(med["time_vs_paged_pct"])
        variants[name] = med
    steps = {}
    for mode, result in raw.get("profile", {}).items():
        for phase in result["phases"]:
            steps[f"{mode} {phase['phase']}"] = {p: phase[p] for p in (*profile.PARTS,
                                                                      "step_ms")}
    layout = default_layout("cpu")
    cpu_default = {"kv_layout": layout, "page_size": HOST_PAGE_SIZE[layout],
                   "premap_pages": raw["variants"].get("virtual", {}).get("premap_pages")}
    return {"variants": variants, "profile_steps": steps, "tlb_counters": tlb_readable(),
            "cpu_default": cpu_default,
            "background_mapper": MAPPER_ON_CPU,
            "touch_us_per_page": {str(k): v for k, v in touch_us.items()}}


def _tlb_cell(per_step: dict[str, float] | None) -> str:
    if not per_step:
        return "not readable"
    return ", ".join(f"{e} {num(n)}" for e, n in per_step.items())


def _draw_shares(variants: dict[str, Any]) -> Callable[[str], None]:
    def draw(path: str) -> None:
        from vmkv.bench.plots import pyplot, save

        names = [n for n in variants if n != "paged"]
        fig, ax = pyplot().subplots(figsize=(9, 0.8 + 0.5 * len(names)))
        left = [0.0] * len(names)
        for key, label in (("map_pct", "map + unmap calls"), ("create_pct", "page create + "
                           "release"), ("first_touch_pct", "first touch (faults + zero-fill, "
                                                           "est.)")):
            values = [variants[n][key] for n in names]
            ax.barh(range(len(names)), values, left=left, label=label)
            left = [a + b for a, b in zip(left, values, strict=True)]
        slow = [variants[n].get("time_vs_paged_pct") for n in names]
        if all(v is not None for v in slow):
            ax.plot(slow, range(len(names)), "kD", label="run time vs paged (%)")
        ax.axvline(0, color="k", lw=0.6)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.set(xlabel="% of the run's time")
        ax.legend(fontsize=7)
        save(fig, path)

    return draw


def _draw_profile(steps: dict[str, Any]) -> Callable[[str], None]:
    def draw(path: str) -> None:
        from vmkv.bench.plots import pyplot, save

        phases = sorted({n.split()[-1] for n in steps})  # decode, prefill
        fig, axes = pyplot().subplots(1, len(phases), figsize=(4.5 * len(phases), 3.6),
                                      squeeze=False)
        for ax, phase in zip(axes[0], phases, strict=True):
            names = [n for n in steps if n.endswith(phase)]
            bottom = [0.0] * len(names)
            for part in profile.PARTS:
                values = [steps[n][part] for n in names]
                ax.bar(range(len(names)), values, bottom=bottom, label=part)
                bottom = [a + b for a, b in zip(bottom, values, strict=True)]
            ax.set_xticks(range(len(names)), names, fontsize=8)
            ax.set(ylabel="ms per step", title=phase)
        axes[0][0].legend(fontsize=7)
        save(fig, path)

    return draw


def section(doc: dict[str, Any], study: dict[str, Any]) -> Section:
    s, cmd, raw = doc["summary"], doc["commands"], doc["raw"]
    variants = s["variants"]
    tlb = s["tlb_counters"]
    shares = Figure(
        name="tax-shares",
        question="What share of the run does each part of the virtual tax take, per page size, "
                 "layout, pre-mapping and pool, and how does the run time compare with paged?",
        columns=["variant", "out tok/s", "step ms", "map+unmap calls", "map+unmap ms",
                 "pages created", "create+release ms", "first touch ms (est.)",
                 "minor faults / step", "TLB misses / step", "tax % of run",
                 "run time vs paged %", "engine start s"],
        rows=[[n, v["output_tokens_per_s"], v["step_ms"], v["map_calls"], v["map_ms"],
               v["pages_created"], v["create_ms"], v["first_touch_ms"],
               v["minor_faults_per_step"], _tlb_cell(v["tlb_misses_per_step"]), v["tax_pct"],
               v.get("time_vs_paged_pct"), v["engine_init_s"]]
              for n, v in variants.items()],
        command=cmd["variants"], draw=_draw_shares(variants),
        notes=[f"Workload: the {raw['workload']['mix']} mix, "
               f"{num(raw['workload']['num_requests'])} requests "
               f"({num(raw['workload']['input_tokens'])} prompt and "
               f"{num(raw['workload']['output_tokens'])} output tokens), medians of "
               f"{num(doc['scale_settings']['repeats'])} alternated repetitions. First touch "
               "per page (µs, `bench vmm`): " + ", ".join(
                   f"{k} B: {num(v)}" for k, v in s["touch_us_per_page"].items()) + ".",
               ("TLB misses: " + (tlb["reason"] if tlb["readable"] else
                                  f"**not readable on this machine** ({tlb['reason']}).")),
               "Zeroing: a page created during a run is zero-filled by the kernel at its first "
               "touch (the estimate above); paged mode zero-fills its whole block pool, and a "
               "pre-created virtual pool is allocated, while the engine starts (engine start "
               "s), outside the measured runs.",
               f"Background mapper: {s['background_mapper']}"])
    steps = s["profile_steps"]
    parts = ["step_ms", *profile.PARTS]
    prof = Figure(
        name="tax-step-parts",
        question="Where does one decode step and one prefill step go in each mode, and which "
                 "parts differ between virtual and paged?",
        columns=["part", *(f"{n} ms" for n in steps)],
        rows=[[p, *(steps[n][p] for n in steps)] for p in parts],
        command=cmd["profile"], draw=_draw_profile(steps))
    default = variants.get("virtual", {})
    reading = []
    if default:
        d = s["cpu_default"]
        reading.append(
            f"The CPU default (virtual, {d['kv_layout']} layout, {num(d['page_size'])}-byte "
            f"pages, {num(d['premap_pages'])} pages mapped ahead per growth) spends "
            f"{num(default['map_pct'])} % of the run in map and unmap calls "
            f"({num(default['map_calls'])} calls), {num(default['create_pct'])} % creating and "
            f"releasing pages and an estimated {num(default['first_touch_pct'])} % in the first "
            f"touch of the {num(default['pages_created'])} pages it created "
            f"({num(default['bytes_created'])} bytes, faulted in and zero-filled by the "
            f"kernel): {num(default['tax_pct'])} % in all; its run time differs from paged's "
            f"by {num(default.get('time_vs_paged_pct'))} %.")
    return Section(TITLE, reading, [shares, prof])


def commands(scale: Scale, study: str) -> dict[str, str]:
    b, c = scale.profile_batch, scale.profile_context
    pb, pl = scale.profile_prefill
    return {"variants": f"{study}  (one variant alone: vmkv bench throughput --kv-mode virtual "
                        f"--dtype float32 --input-len LO:HI --output-len LO:HI --num-prompts "
                        f"{scale.num_prompts} --premap-pages N --page-size S --kv-layout L)",
            "profile": f"{study}  (alone: vmkv bench profile --kv-mode virtual|paged --dtype "
                       f"float32 --batch-size {b} --context-len {c} --prefill-batch {pb} "
                       f"--prefill-len {pl} --repeats {scale.profile_repeats} --warmup 1)"}
