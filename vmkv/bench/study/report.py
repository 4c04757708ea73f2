"""study.md from study.json alone: the answer first (virtual faster or slower than paged here,
by how much, why), the machine, then each part's figures with their question, numbers and
command. Numbers are JSON values written by :func:`~vmkv.bench.study.fmt.num` (the test
checks every number token of the markdown against the JSON)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from vmkv.bench.study import PARTS, kv_dtype
from vmkv.bench.study.figure import Figure, Section
from vmkv.bench.study.fmt import num

IMAGES = Path("images/study")
PARITY_WORDS = {"faster than": "faster", "slower than": "slower", "at parity with": "as fast"}


def cell(value: Any) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool) or value is None:
        return num(value)
    return str(value).replace("|", "\\|").replace("\n", " ")


def table(columns: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]


def _parts(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Parts that have their numbers (no error)."""
    return {k: v for k, v in doc["parts"].items() if "summary" in v}


def _kernel_sentence(t: dict[str, Any]) -> str | None:
    ratio = t["engine_default_decode_ratio"]
    if ratio is None:
        return None
    if ratio > 1.01:
        how = "reads a contiguous virtual slot faster than through a block table"
    elif ratio < 0.99:
        how = "reads K/V through a block table faster than from a contiguous slot"
    else:
        how = "reads K/V as fast through a block table as from a contiguous slot"
    return (f"**The kernel** {how}: paged / virtual decode time per layer {num(ratio)} "
            f"(median over {num(t['engine_default_points'])} batch × context points at the "
            f"engine's {t['engine_layout']} layout; part 2).")


def _tax_sentence(x: dict[str, Any]) -> str | None:
    v = x["variants"].get("virtual")
    if not v:
        return None
    slower = v.get("time_vs_paged_pct")
    vs = ("" if slower is None else
          f"; that engine's run took {num(v['time_vs_paged_abs_pct'])} % "
          f"{'longer' if slower > 0 else 'less'} than paged's on the same requests")
    return (f"**The virtual tax** of the default engine (map and unmap calls, page creation, "
            f"the first touch of fresh pages) is {num(v['tax_pct'])} % of the run: "
            f"{num(v['map_pct'])} % mapping ({num(v['map_calls'])} calls), "
            f"{num(v['create_pct'])} % creating pages, {num(v['first_touch_pct'])} % first "
            f"touch (est.){vs} (part 3).")


def _step_sentence(x: dict[str, Any]) -> str | None:
    steps = x["profile_steps"]
    v, p = steps.get("virtual decode"), steps.get("paged decode")
    if not v or not p:
        return None
    return (f"**A decode step** takes {num(v['step_ms'])} ms virtual vs {num(p['step_ms'])} ms "
            f"paged: attention {num(v['attention'])} vs {num(p['attention'])} ms, K/V write "
            f"{num(v['kv_write'])} vs {num(p['kv_write'])} ms, engine Python (scheduler, KV "
            f"manager, mapping) {num(v['engine_python'])} vs {num(p['engine_python'])} ms, "
            f"the model's GEMMs {num(v['gemm'])} vs {num(p['gemm'])} ms (part 3).")


def answer(doc: dict[str, Any]) -> list[str]:
    """The first screen: the verdict with its size, then the reasons, in the JSON's numbers."""
    parts = _parts(doc)
    e2e = parts.get("end_to_end", {}).get("summary")
    lines = []
    if e2e is None:
        lines.append("**Virtual vs paged: not measured yet** (the end-to-end part is missing; "
                     f"`{doc['study']['command']}` measures it).")
    else:
        word = PARITY_WORDS[e2e["verdict"]]
        size = ("" if e2e["verdict"] == "at parity with" else
                f", by {num(e2e['difference_pct'])} %")
        lines.append(
            f"**Virtual is {word} {'as' if word == 'as fast' else 'than'} paged on this "
            f"machine{size}**: virtual / paged output tokens/s {num(e2e['ratio_median'])} "
            f"(median of {num(e2e['runs_compared'])} mix × dtype comparisons, each the median "
            f"of alternated repetitions; from {num(e2e['ratio_min'])} to "
            f"{num(e2e['ratio_max'])}; within {num(e2e['parity_pct'])} % counts as parity).")
    why = []
    if "translation" in parts:
        why.append(_kernel_sentence(parts["translation"]["summary"]))
    if "tax" in parts:
        why += [_tax_sentence(parts["tax"]["summary"]), _step_sentence(parts["tax"]["summary"])]
    if "memory" in parts:
        m = parts["memory"]["summary"]["mixes"].get("balanced")
        if m:
            why.append(f"**Memory**: on the balanced mix virtual's default pages keep "
                       f"{num(m['engine_default_pct'])} % of the KV memory useful against "
                       f"{num(m['paged_pct'])} % for 16-token blocks (part 1).")
    why = [w for w in why if w]
    if doc.get("answer"):
        why.append(_sum_sentence(doc["answer"]))
    if why:
        lines += ["", "Why:", ""] + [f"- {w}" for w in why]
    if "kv_dtype" in parts:
        lines += ["", kv_dtype.auto_sentence(parts["kv_dtype"]["summary"])]
    return lines


def _direction(pct: float) -> str:
    return "faster" if pct > 0 else "slower"


def _sum_sentence(a: dict[str, Any]) -> str:
    kernel = ("saves" if a["kernel_gain_pct"] >= 0 else "adds")
    return (f"**In sum** (an estimate from parts 2 and 3): the virtual kernel {kernel} "
            f"{num(a['kernel_gain_abs_pct'])} % of a decode step (attention is "
            f"{num(a['attention_share_pct'])} % of it) and the tax costs {num(a['tax_pct'])} % "
            f"of a run, which predicts virtual {num(a['expected_abs_pct'])} % "
            f"{_direction(a['expected_pct'])} than paged; measured: "
            f"{num(a['measured_abs_pct'])} % {_direction(a['measured_pct'])} (mix × dtype "
            f"medians from {num(a['measured_min_pct'])} to {num(a['measured_max_pct'])} %).")


def _machine(doc: dict[str, Any]) -> list[str]:
    env = doc["environment"]
    thp = env["transparent_hugepage"]
    tlb = env["tlb_counters"]
    rows = [
        ["CPU", f"{env['cpu_model']}, {num(env['cores'])} cores ({num(env['cores_usable'])} "
                f"usable), bfloat16 hardware: {', '.join(env['bf16_hardware']) or 'none'}"],
        ["memory", f"{num(env['memory_bytes'])} bytes"],
        ["kernel", env["kernel"]],
        ["transparent huge pages", f"enabled {thp['enabled']}, defrag {thp['defrag']}, shmem "
                                   f"{thp['shmem_enabled']}"],
        ["TLB-miss counters", tlb["reason"]],
        ["versions", ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v)],
        ["commit", f"{env['commit_full']}"
                   + (" (with uncommitted changes)" if env["uncommitted_changes"] else "")],
        ["load average at the report", ", ".join(num(x) for x in env["load_average"])],
    ]
    flags = " ".join(env["cpu_flags"])
    return (table(["", ""], rows)
            + ["", f"<details><summary>CPU flags</summary>\n\n{flags}\n\n</details>"])


def _runs(doc: dict[str, Any]) -> list[str]:
    rows = []
    for name, p in doc["parts"].items():
        if "error" in p:
            rows.append([name, p["scale"], "failed", p["error"], "", "", ""])
        else:
            rows.append([name, p["scale"], p["seconds"], p["finished"], p.get("cpu", "-"),
                         ", ".join(num(x) for x in p["load_average_before"]), p["commit"]])
    return table(["part", "scale", "seconds", "finished", "machine", "load average before",
                  "commit"], rows)


def _figure(fig: Figure, out: Path) -> list[str]:
    lines = [f"### {fig.question}", ""]
    if fig.draw is not None:
        path = out / IMAGES / f"{fig.name}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.draw(str(path))
        lines += [f"![{fig.name}]({(IMAGES / f'{fig.name}.png').as_posix()})", ""]
    lines += table(fig.columns, fig.rows) + [""]
    lines += [*fig.notes, ""] if fig.notes else []
    return lines + [f"Command: `{fig.command}`", ""]


def _section(number: int, section: Section, out: Path) -> list[str]:
    lines = [f"## {num(number)}. {section.title}", "", *section.reading, ""]
    lines += [f"- {m}" for m in section.missing] + ([""] if section.missing else [])
    for fig in section.figures:
        lines += _figure(fig, out)
    return lines


def render(doc: dict[str, Any], out: Path) -> str:
    """The markdown (drawing the figures into ``out / IMAGES`` on the way)."""
    env = doc["environment"]
    scale = doc["study"]["scale"]
    # the headline is the end-to-end part's: named by the machine it ran on
    where = (doc["parts"].get("end_to_end", {}).get("cpu")
             or f"{env['cpu_model']}, {num(env['cores'])} cores")
    lines = [f"# Virtual vs paged KV cache on {where}",
             "", *answer(doc), ""]
    if scale != "full":
        lines += [f"*This is a `{scale}` run: fewer and shorter requests than the full study, "
                  "on a machine that may have been busy; it shows the study's shape, not this "
                  f"machine's performance. The full study: `{doc['study']['full_command']}`.*",
                  ""]
    lines += [f"Reproduce on your machine: `{doc['study']['command']}` (resumable; `--parts` "
              "and `--force` rerun parts; `--quick` for a short run).", ""]
    history = out / "results" / "HISTORY.md"
    if history.exists():
        lines += ["Earlier measurements, in the order they were taken: "
                  "[results/HISTORY.md](results/HISTORY.md); all results: "
                  "[results.md](results.md).", ""]
    lines += ["## The machine", "",
              "Where this report was written (each part's own machine: the table after it).",
              "", *_machine(doc), "", "Parts as measured:", "",
              *_runs(doc), ""]
    for number, part in enumerate(PARTS, 1):
        pdoc = doc["parts"].get(part.NAME)
        if pdoc is None or "summary" not in pdoc:
            why = f" (failed: {pdoc['error']})" if pdoc else ""
            lines += [f"## {num(number)}. {part.TITLE}", "",
                      f"Not measured yet{why}: `{doc['study']['command']} --parts "
                      f"{part.NAME}`.", ""]
            continue
        lines += _section(number, part.section(pdoc, doc), out)
    return "\n".join(lines).rstrip() + "\n"


def write(doc: dict[str, Any], out: Path) -> Path:
    """Render ``doc`` to ``out / "study.md"`` and its figures; returns the markdown's path."""
    path = out / "study.md"
    text = render(doc, out)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path
