"""Part 1, memory efficiency: the useful fraction of KV memory per strategy (naive reservation,
16-token blocks, virtual pages per size and layout), from the real managers
(:func:`vmkv.bench.memory.run`), on the seed's lengths and on the three workload mixes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from vmkv.bench import memory
from vmkv.bench.study.figure import Figure, Section
from vmkv.bench.study.fmt import num
from vmkv.bench.study.scale import KiB, MiB, Scale
from vmkv.bench.workloads import MIXES, random_workload

NAME, TITLE = "memory", "Memory efficiency"
#: what the seed's comments say its code prints (it prints 19.88 % and 98.82 %)
SEED_COMMENT_PCT = {"naive": 20.8, "paged": 99.1}
PAGES = (16 * KiB, 64 * KiB)
LARGE_PAGE = 2 * MiB


def mix_lengths(mix: str, n: int) -> list[int]:
    """Final lengths (prompt + output) of the mix's first ``n`` requests, at full length, as the
    end-to-end part draws them (seed 0)."""
    prompt, output = MIXES[mix]
    requests = random_workload(n, np.arange(8), input_len=prompt, output_len=output, seed=0)
    return [len(r.prompt_token_ids) + r.output_len for r in requests]


def _measure(lengths: list[int], large_layouts: tuple[str, ...]) -> dict[str, Any]:
    small = memory.run(lengths, page_sizes=PAGES)
    large = memory.run(lengths, page_sizes=(LARGE_PAGE,), layouts=large_layouts)
    return {**small, "rows": small["rows"] + large["rows"][2:]}  # naive, paged once


def tasks(scale: Scale, raw: dict[str, Any]) -> list[tuple[str, Callable[[], None]]]:
    def seed() -> None:
        raw["seed"] = _measure(list(memory.SEED_LENGTHS), ("all-layers", "per-layer"))

    def mix(name: str) -> None:  # per-layer 2 MiB pages would commit GiBs for 64 requests
        raw.setdefault("mixes", {})[name] = _measure(mix_lengths(name, scale.memory_prompts),
                                                     ("all-layers",))

    return [("seed lengths", seed)] + [(name, lambda n=name: mix(n)) for name in MIXES]


def _pct(result: dict[str, Any], strategy: str, setting: str | None = None) -> float:
    return next(r["useful_pct"] for r in result["rows"]
                if r["strategy"] == strategy and (setting is None or r["setting"] == setting))


def summarise(raw: dict[str, Any], scale: Scale) -> dict[str, Any]:
    engine_default = "per-layer, page 16 KiB"
    out: dict[str, Any] = {"seed_comment_pct": SEED_COMMENT_PCT,
                           "seed_measured_pct": {"naive": _pct(raw["seed"], "naive"),
                                                 "paged": _pct(raw["seed"], "paged")},
                           "engine_default_setting": engine_default, "mixes": {}}
    for mix, result in raw["mixes"].items():
        virtual = [r for r in result["rows"] if r["strategy"] == "virtual"]
        best = max(virtual, key=lambda r: r["useful_pct"])
        out["mixes"][mix] = {
            "requests": len(result["lengths"]), "paged_pct": _pct(result, "paged"),
            "engine_default_pct": _pct(result, "virtual", engine_default),
            "best_virtual_setting": best["setting"], "best_virtual_pct": best["useful_pct"],
            "naive_pct": _pct(result, "naive"),
        }
    return out


def _draw_rows(groups: dict[str, dict[str, Any]], title: str) -> Callable[[str], None]:
    def draw(path: str) -> None:
        from vmkv.bench.plots import pyplot, save

        first = next(iter(groups.values()))["rows"]
        labels = [f"{r['strategy']}\n{r['setting']}" for r in first]
        fig, ax = pyplot().subplots(figsize=(11, 3.8))
        width = 0.8 / len(groups)
        for i, (name, result) in enumerate(groups.items()):
            x = np.arange(len(labels)) + i * width
            ax.bar(x, [r["useful_pct"] for r in result["rows"]], width, label=name)
        ax.set_xticks(np.arange(len(labels)) + 0.4 - width / 2, labels, fontsize=7)
        ax.set(ylabel="useful KV memory %", ylim=(0, 100), title=title)
        ax.legend(fontsize="small")
        save(fig, path)

    return draw


def section(doc: dict[str, Any], study: dict[str, Any]) -> Section:
    raw, s, cmd = doc["raw"], doc["summary"], doc["commands"]
    seed = raw["seed"]
    seed_fig = Figure(
        name="memory-seed",
        question="On the seed's eight request lengths, what fraction of the KV memory each "
                 "strategy holds stores live tokens?",
        columns=["strategy", "setting", "useful %", "bytes in use", "map calls"],
        rows=[[r["strategy"], r["setting"], r["useful_pct"], r["bytes_in_use"], r.get("maps")]
              for r in seed["rows"]],
        command=cmd["seed"], draw=_draw_rows({"seed lengths": seed}, "the seed's lengths"),
        notes=[f"Lengths {', '.join(num(n) for n in seed['lengths'])}; KV of "
               f"{num(seed['kv_shape']['bytes_per_token'])} bytes per token. **The seed's "
               f"comments are wrong**: they say {num(s['seed_comment_pct']['naive'])} % "
               f"(naive) and {num(s['seed_comment_pct']['paged'])} % (paged), but its code on "
               f"its own lengths gives the {num(s['seed_measured_pct']['naive'])} % and "
               f"{num(s['seed_measured_pct']['paged'])} % measured here."])
    mixes = raw["mixes"]
    names = list(mixes)
    settings = [(r["strategy"], r["setting"]) for r in mixes[names[0]]["rows"]]
    mix_fig = Figure(
        name="memory-mixes",
        question="On the three workload mixes, which allocation wastes the least KV memory, "
                 "and at which page size and layout?",
        columns=["strategy", "setting", *(f"{m} useful %" for m in names)],
        rows=[[st, se, *(next(r["useful_pct"] for r in mixes[m]["rows"]
                              if (r["strategy"], r["setting"]) == (st, se)) for m in names)]
              for st, se in settings],
        command=cmd["mixes"], draw=_draw_rows(mixes, "final lengths of each mix"),
        notes=[f"{m}: {num(v['requests'])} requests; paged {num(v['paged_pct'])} %, the "
               f"engine's default virtual setting ({s['engine_default_setting']}) "
               f"{num(v['engine_default_pct'])} %, best virtual {v['best_virtual_setting']} "
               f"{num(v['best_virtual_pct'])} %." for m, v in s["mixes"].items()])
    reading = ["A request wastes at most the unused end of its last block (paged) or of its "
               "last page in every region (virtual: one region for all-layers pages, which hold "
               "a few tokens of every layer; one per layer and K/V for per-layer pages, which "
               "keep each layer's rows contiguous, as the CPU decode kernel reads them). "
               + " ".join(mix_fig.notes)]
    return Section(TITLE, reading, [seed_fig, mix_fig])


def commands(scale: Scale, study: str) -> dict[str, str]:
    pages = "16K,64K,2M"
    return {"seed": f"{study}  (alone: vmkv bench memory --page-sizes {pages})",
            "mixes": f"{study}  (alone: vmkv bench memory --page-sizes {pages} --lengths "
                     f"<prompt + output lengths of the mix's {scale.memory_prompts} requests>)"}
