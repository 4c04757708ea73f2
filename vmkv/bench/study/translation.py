"""Part 2, translation cost in the kernel: attention alone, per layer, reading each request's
K/V from a contiguous virtual slot or through a block table (``vmkv bench kernels``: the
engine's own CPU backends over real KV managers; on a GPU also the Triton twins), across
context lengths, both virtual layouts, page sizes and block sizes."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from vmkv.bench import kernels
from vmkv.bench.study.figure import Figure, Section
from vmkv.bench.study.fmt import num
from vmkv.bench.study.scale import Scale

NAME, TITLE = "translation", "Translation cost in the kernel"
LAYOUTS = ("per-layer", "all-layers")  # the CPU engine's default first


def _run(scale: Scale, *, layout: str, phases: tuple[str, ...], page: int | None = None,
         block: int = 16) -> dict[str, Any]:
    result = kernels.run(scale.kernel_batches, scale.kernel_contexts, phases=phases,
                         prefill_len=scale.kernel_prefill_len, layout=layout, block_size=block,
                         page_size=page, repeats=scale.kernel_repeats,
                         warmup=scale.kernel_warmup, progress=False)
    return {"layout": layout, "page_size": page, "block_size": block, "phases": list(phases),
            "result": result}


def tasks(scale: Scale, raw: dict[str, Any]) -> list[tuple[str, Callable[[], None]]]:
    raw.setdefault("runs", [])
    todo: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        (f"{layout}, default page", lambda lay=layout: _run(scale, layout=lay,
                                                             phases=scale.kernel_phases))
        for layout in LAYOUTS]
    todo += [(f"{layout}, page {page // 1024}K, decode",
              lambda lay=layout, p=page: _run(scale, layout=lay, phases=("decode",), page=p))
             for layout, page in scale.kernel_pages]
    todo += [(f"block {block}, decode",
              lambda b=block: _run(scale, layout=LAYOUTS[0], phases=("decode",), block=b))
             for block in scale.kernel_blocks]
    return [(label, lambda f=f: raw["runs"].append(f())) for label, f in todo]


def variant_name(run: dict[str, Any]) -> str:
    page = "default page" if run["page_size"] is None else f"page {run['page_size'] // 1024}K"
    return f"{run['layout']}, {page}, block {run['block_size']}"


def summarise(raw: dict[str, Any], scale: Scale) -> dict[str, Any]:
    """Median paged/virtual time per (variant, device, phase) over its points (> 1: the block
    table costs time), with the smallest and largest point."""
    groups: dict[str, dict[str, Any]] = {}
    for run in raw["runs"]:
        for row in run["result"]["rows"]:
            key = f"{variant_name(run)}: {row['device']} {row['phase']}"
            ratio = row.get("ratio")
            if ratio is not None:
                groups.setdefault(key, {"ratios": []})["ratios"].append(ratio)
    for g in groups.values():
        g.update(median=statistics.median(g["ratios"]), min=min(g["ratios"]),
                 max=max(g["ratios"]), points=len(g["ratios"]))
    default = f"{variant_name(raw['runs'][0])}: cpu decode"
    found = groups.get(default)
    return {"groups": groups, "engine_default": default, "engine_layout": LAYOUTS[0],
            "engine_default_decode_ratio": found["median"] if found else None,
            "engine_default_points": found["points"] if found else 0}


def _plots() -> Any:
    from vmkv.bench import plots

    return plots


def _figure(run: dict[str, Any], name: str, command: str) -> Figure:
    result = run["result"]
    return Figure(
        name=name,
        question=f"How much longer does one layer's attention take reading K/V through a block "
                 f"table than from a contiguous slot ({run['layout']} virtual layout)?",
        columns=["device", "phase", "batch", "context", "virtual ms", "paged ms",
                 "paged / virtual"],
        rows=[[r["device"], r["phase"], r["batch"], r["context"], r.get("virtual_ms"),
               r.get("paged_ms") or r.get("shuffled_ms"), r.get("ratio")]
              for r in result["rows"]],
        command=command,
        draw=lambda path: _plots().kernels(result, path),
        notes=([f"Skipped (over the bench's token limit): {', '.join(result['skipped'])}."]
               if result["skipped"] else []))


def _draw_variants(groups: dict[str, Any]) -> Callable[[str], None]:
    def draw(path: str) -> None:
        from vmkv.bench.plots import pyplot, save

        names = [k for k in groups if k.endswith("cpu decode")]
        fig, ax = pyplot().subplots(figsize=(8, 0.5 + 0.45 * len(names)))
        ax.barh(range(len(names)), [groups[n]["median"] for n in names],
                xerr=[[groups[n]["median"] - groups[n]["min"] for n in names],
                      [groups[n]["max"] - groups[n]["median"] for n in names]])
        ax.set_yticks(range(len(names)), [n.removesuffix(": cpu decode") for n in names],
                      fontsize=7)
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set(xlabel="paged / virtual decode time (median, range over points)")
        save(fig, path)

    return draw


def section(doc: dict[str, Any], study: dict[str, Any]) -> Section:
    raw, s, cmd = doc["raw"], doc["summary"], doc["commands"]
    figures = [_figure(run, f"translation-{run['layout']}", cmd["main"])
               for run in raw["runs"] if run["page_size"] is None and run["block_size"] == 16]
    groups = s["groups"]
    figures.append(Figure(
        name="translation-variants",
        question="Does the block table's cost in decode change with the virtual page size, "
                 "the layout or the block size?",
        columns=["variant: device phase", "points", "median paged / virtual", "min", "max"],
        rows=[[k, g["points"], g["median"], g["min"], g["max"]] for k, g in groups.items()],
        command=cmd["variants"], draw=_draw_variants(groups)))
    ratio = s["engine_default_decode_ratio"]
    reading = ([f"At the CPU engine's {s['engine_layout']} layout, the paged decode kernel "
                f"takes {num(ratio)}× the virtual one's time per layer (median over "
                f"{num(s['engine_default_points'])} points; above 1 the block table costs time, "
                "below 1 the contiguous slot does)."] if ratio is not None else [])
    return Section(TITLE, reading, figures)


def commands(scale: Scale, study: str) -> dict[str, str]:
    common = (f"--batch-sizes {','.join(map(str, scale.kernel_batches))} --context-lens "
              f"{','.join(map(str, scale.kernel_contexts))} --repeats {scale.kernel_repeats} "
              f"--warmup {scale.kernel_warmup}")
    return {"main": f"{study}  (alone: vmkv bench kernels {common} --phases "
                    f"{','.join(scale.kernel_phases)} --prefill-len {scale.kernel_prefill_len} "
                    "--kv-layout per-layer|all-layers)",
            "variants": f"{study}  (alone: vmkv bench kernels {common} --phases decode "
                        "--kv-layout L --block-size B; the page size is the study's own "
                        "setting)"}
