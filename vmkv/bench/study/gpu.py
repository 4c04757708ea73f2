"""The GPU sections: the study reads the results of ``benchmarks/gpu/check.sh`` (page-operation
latency and the background mapper's stall on the GPU, the Triton and CUDA twins' translation
cost, a decode step virtual vs paged) where a run on a GPU left them; until then it says which
numbers are missing and which command produces them. Reading files only: re-read on every
study run."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vmkv.bench.study.figure import Figure, Section
from vmkv.bench.study.scale import Scale

NAME, TITLE = "gpu", "On a GPU"
ROOT = Path(__file__).resolve().parents[3]
#: where check.sh's results are looked for, first found wins (a CPU dry run does not count)
SEARCH = ("docs/results/gpu-check", "benchmarks/results/gpu-check-*")
STEPS = ("s2_vmm_latency", "s6_decode", "s7_twins")
COMMAND = "OUT=docs/results/gpu-check bash benchmarks/gpu/check.sh  (on a machine with a GPU)"
#: what each step measures for the study, by part
MISSING = {
    "s2_vmm_latency": "part 4 on the GPU: cuMemCreate / cuMemMap / cuMemSetAccess / "
                      "cuMemUnmap / cuMemRelease latency per 2 MiB page, and the background "
                      "mapper's stall while the GPU computes",
    "s6_decode": "part 5 on the GPU: a Llama-3-8B-shaped decode step, virtual vs paged, eager "
                 "and CUDA graphs, against the memory roofline",
    "s7_twins": "part 2 on the GPU: the Triton and CUDA decode twins reading K/V contiguously, "
                "through an identity block table and through a shuffled one",
}


def find_results(extra: str | None = None) -> Path | None:
    """The newest folder with a GPU (not CPU dry-run) ``summary.json`` of check.sh."""
    candidates = [Path(extra)] if extra else []
    for pattern in SEARCH:
        candidates += sorted(ROOT.glob(pattern), reverse=True)
    for folder in candidates:
        summary = folder / "summary.json"
        try:
            if json.loads(summary.read_text()).get("device") not in (None, "cpu"):
                return folder
        except (OSError, ValueError):
            continue
    return None


def tasks(scale: Scale, raw: dict[str, Any], results: str | None = None
          ) -> list[tuple[str, Callable[[], None]]]:
    def read() -> None:
        folder = find_results(results)
        shown = folder.relative_to(ROOT) if folder and folder.is_relative_to(ROOT) else folder
        raw.update(searched=list(SEARCH) + ([results] if results else []),
                   folder=str(shown) if folder else None, steps={},
                   notes_page=("docs/gpu-results.md" if (ROOT / "docs/gpu-results.md").exists()
                               else None))
        if folder is None:
            return
        raw["summary"] = json.loads((folder / "summary.json").read_text())
        for step in STEPS:
            path = folder / f"{step}.json"
            if path.exists():
                raw["steps"][step] = json.loads(path.read_text())

    return [("read GPU check results", read)]


def _vmm_rows(s2: dict[str, Any]) -> list[dict[str, Any]]:
    ops = s2.get("data", {}).get("engine_thread", {})
    if "map" not in ops:
        return []
    p = lambda op, q: ops.get(op, {}).get(f"{q}_us") if isinstance(ops.get(op), dict) else None  # noqa: E731
    return [{"device": "cuda (check.sh)", "page_size": 2 << 20, "pages": ops["map"]["n"],
             "create_p50_us": p("create", "p50"), "map_p50_us": p("map", "p50"),
             "map_p99_us": p("map", "p99"), "touch_p50_us": p("touch", "p50"),
             "unmap_p50_us": p("unmap", "p50"), "unmap_p99_us": p("unmap", "p99"),
             "release_p50_us": p("release", "p50")}]


def _decode_rows(s6: dict[str, Any]) -> list[dict[str, Any]]:
    """s6's paged / virtual ratios, with each mode's kernel and step time."""
    kernels = {m: s6.get(f"{m}_setup", {}).get("kernel") for m in ("virtual", "paged")}
    # (mode, kernel, batch, context) -> row; rows before 2026-12-04 name no kernel: the default
    times = {(r.get("mode"), r.get("kernel", kernels.get(r.get("mode"))), r.get("batch"),
              r.get("context")): r for r in s6.get("rows", [])}
    out = []
    for r in s6.get("paged_over_virtual", []):
        ms = {(m, k): times.get((m, k, r["batch"], r["context"]), {}).get(r["timing"])
              for m, k in (("virtual", kernels["virtual"]), ("paged", kernels["paged"]),
                           ("virtual", "aten-flash"))}
        row = {**r, "virtual_kernel": kernels["virtual"], "paged_kernel": kernels["paged"],
               "virtual_ms": ms["virtual", kernels["virtual"]],
               "paged_ms": ms["paged", kernels["paged"]]}
        if kernels["virtual"] != "aten-flash":  # s6 also times FA2 on the slot views
            row["virtual_aten_flash_ms"] = ms["virtual", "aten-flash"]
        out.append(row)
    return out


def summarise(raw: dict[str, Any], scale: Scale) -> dict[str, Any]:
    steps = raw["steps"]
    missing = [f"{MISSING[s]} (`{s}`)" for s in STEPS if s not in steps or
               not steps[s].get("ok")]
    return {"available": bool(steps), "folder": raw["folder"], "missing": missing,
            "command": COMMAND,
            "vmm_rows": _vmm_rows(steps["s2_vmm_latency"]) if "s2_vmm_latency" in steps else [],
            "mapper": steps.get("s2_vmm_latency", {}).get("data", {}).get("mapper"),
            "twins": steps.get("s7_twins", {}).get("data", {}).get("rows", []),
            "decode": _decode_rows(steps.get("s6_decode", {}).get("data", {})),
            "device": raw.get("summary", {}).get("device")}


def section(doc: dict[str, Any], study: dict[str, Any]) -> Section:
    s, raw = doc["summary"], doc["raw"]
    figures = []
    if s["twins"]:
        keys = [k for k in s["twins"][0] if k.endswith("_ms") or "_over_" in k]
        figures.append(Figure(
            name="gpu-twins", question="On the GPU, what does a block table cost the decode "
            "kernel: an identity table (pure indirection) and a shuffled one (indirection and "
            "locality), against contiguous slots?",
            columns=["batch", "context", "block", *keys],
            rows=[[r["batch"], r["context"], r["block"], *(r.get(k) for k in keys)]
                  for r in s["twins"]], command=s["command"], draw=None))
    if s["decode"]:
        fa2 = any(r.get("virtual_aten_flash_ms") is not None for r in s["decode"])
        figures.append(Figure(
            name="gpu-decode", question="On the GPU, is a whole decode step of an 8B-shaped "
            "model slower with a block table?",
            columns=["batch", "context", "timing", "virtual kernel", "virtual ms",
                     "paged kernel", "paged ms", "paged / virtual",
                     *(["virtual aten-flash ms"] if fa2 else [])],
            rows=[[r["batch"], r["context"], r["timing"], r.get("virtual_kernel"),
                   r.get("virtual_ms"), r.get("paged_kernel"), r.get("paged_ms"),
                   r["paged_over_virtual"], *([r.get("virtual_aten_flash_ms")] if fa2 else [])]
                  for r in s["decode"]], command=s["command"], draw=None))
    if s["mapper"]:
        m = s["mapper"]
        figures.append(Figure(
            name="gpu-mapper", question="On the GPU, how long does a step wait for the "
            "background mapper?",
            columns=["jobs", "units", "busy ms", "stall ms", "stall µs p50", "stall µs p99"],
            rows=[[m["jobs"], m["units"], m["busy_ms"], m["stall_ms"], m["stall_p50_us"],
                   m["stall_p99_us"]]], command=s["command"], draw=None))
    reading = ([f"From `{s['folder']}` (device: {s['device']})."] if s["available"] else
               ["**No GPU results yet**: no run of the GPU check on a GPU was found (looked in "
                + ", ".join(f"`{p}`" for p in raw["searched"]) + ")."])
    if raw.get("notes_page"):
        reading.append(f"Notes of the GPU runs: `{raw['notes_page']}`.")
    missing = [f"Missing: {m}. Produced by `{s['command']}`, then `vmkv bench study --parts "
               "gpu` (reads them; no other part reruns)." for m in s["missing"]]
    return Section(TITLE, reading, figures, missing)


def commands(scale: Scale, study: str) -> dict[str, str]:
    return {"check": COMMAND}
