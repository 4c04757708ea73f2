"""Run the study's parts into a folder, resumably, and write its report.

    DIR/results/study.json   every raw number, each part's summary, the environment
    DIR/study.md             the report (rendered from study.json only)
    DIR/images/study/*.png   one figure each

A part already in study.json at the same scale is not measured again unless ``force`` or
``parts`` names it; the GPU part (reading files) is re-read every time. study.json is rewritten
after every part, so an interrupted study resumes at the part it was in. A part that fails is
recorded with its error and measured again next time; the others still run.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType
from typing import Any

from vmkv.bench.study import PART_NAMES, PARTS, gpu
from vmkv.bench.study.answer import synthesis
from vmkv.bench.study.counters import tlb_readable
from vmkv.bench.study.environment import describe, machine
from vmkv.bench.study.scale import FULL, Scale

JSON_PATH = Path("results/study.json")


def study_command(scale: Scale, out: str, parts: Sequence[str] = ()) -> str:
    """The one line that measures (and renders) what this run does."""
    flag = {"full": "", "quick": " --quick", "smoke": " --smoke"}[scale.name]
    only = f" --parts {','.join(parts)}" if parts else ""
    return f"vmkv bench study{flag} --out {out}{only}"


def load(out: Path) -> dict[str, Any]:
    path = out / JSON_PATH
    if path.exists():
        return json.loads(path.read_text())
    return {"parts": {}}


def save(doc: dict[str, Any], out: Path) -> None:
    path = out / JSON_PATH
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    tmp.replace(path)


def _wanted(part: ModuleType, doc: dict[str, Any], scale: Scale, parts: Sequence[str],
            force: bool) -> bool:
    if part.NAME == gpu.NAME or force or part.NAME in parts:
        return True
    done = doc["parts"].get(part.NAME)
    return not parts and (done is None or "error" in done or done["scale"] != scale.name)


def measure(part: ModuleType, number: int, scale: Scale, out_arg: str, *, progress: bool,
            gpu_results: str | None, commit: str | None) -> dict[str, Any]:
    """Run one part's tasks under a progress bar; its record for study.json."""
    from tqdm import tqdm

    raw: dict[str, Any] = {}
    todo = (part.tasks(scale, raw, gpu_results) if part is gpu else part.tasks(scale, raw))
    started, load_before = time.monotonic(), os.getloadavg()
    bar = tqdm(todo, desc=f"{number}/{len(PARTS)} {part.NAME}", unit="step",
               dynamic_ncols=True, disable=not progress)
    for label, task in bar:
        bar.set_postfix_str(label)
        task()
    bar.close()
    raw = json.loads(json.dumps(raw, default=str))  # summarised as it is stored
    command = study_command(scale, out_arg, [part.NAME])
    return {"number": number, "title": part.TITLE, "scale": scale.name, "commit": commit,
            "scale_settings": scale.as_dict(), "seconds": time.monotonic() - started,
            "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "cpu": machine(), "load_average_before": list(load_before), "load_average_after":
            list(os.getloadavg()), "commands": part.commands(scale, command), "raw": raw,
            "summary": part.summarise(raw, scale)}


def run(out: Path, scale: Scale, *, out_arg: str | None = None, parts: Sequence[str] = (),
        force: bool = False, progress: bool = True, gpu_results: str | None = None,
        render_only: bool = False) -> int:
    """Measure what is missing (or asked for), then write the report; 0 if every part has
    its numbers, 1 if one failed (its error is in study.json and the report)."""
    from vmkv.bench.study import report

    unknown = set(parts) - set(PART_NAMES)
    if unknown:
        raise ValueError(f"unknown part(s) {sorted(unknown)}; the parts are "
                         f"{', '.join(PART_NAMES)}")
    out_arg = out_arg or str(out)
    doc = load(out)
    here = describe(tlb_readable())
    wanted = [] if render_only else [p for p in PARTS if _wanted(p, doc, scale, parts, force)]
    if "environment" not in doc or any(p is not gpu for p in wanted):
        # the gpu part reads results measured on another machine: it leaves the host's record
        doc["environment"] = here
    doc["study"] = {"command": study_command(scale, out_arg), "scale": scale.name,
                    "full_command": study_command(FULL, out_arg),
                    "parts": {name: number for number, name in enumerate(PART_NAMES, 1)}}
    failed = False
    for number, part in enumerate(PARTS, 1):
        if part not in wanted:
            continue
        minutes = dict(scale.expected_min).get(part.NAME)
        if progress and minutes:
            print(f"{number}/{len(PARTS)} {part.TITLE}: about {minutes:g} min at the "
                  f"{scale.name} scale on 2 cores", flush=True)
        try:
            doc["parts"][part.NAME] = measure(part, number, scale, out_arg,
                                              progress=progress, gpu_results=gpu_results,
                                              commit=here["commit"])
        except Exception as exc:  # noqa: BLE001 - recorded; the other parts still run
            failed = True
            doc["parts"][part.NAME] = {"number": number, "title": part.TITLE,
                                       "scale": scale.name, "error": repr(exc),
                                       "traceback": traceback.format_exc()}
            print(f"{part.NAME} failed: {exc!r}", flush=True)
        save(doc, out)
    doc["answer"] = synthesis({k: v for k, v in doc["parts"].items() if "summary" in v})
    save(doc, out)
    report.write(doc, out)
    print(f"wrote {out / 'study.md'}, {out / JSON_PATH} and {out / report.IMAGES}/")
    return 1 if failed else 0
