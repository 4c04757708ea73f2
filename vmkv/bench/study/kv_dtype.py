"""Part 8, the KV dtype: what ``--kv-cache-dtype int8`` changes against the model's own dtype
(``auto``) for address translation and for speed, on the default model's KV shape:

    geometry   bytes per token, tokens per GiB, tokens per page (the engine's per-layer 16 KiB
               pages and all-layers 2 MiB pages) and bytes per paged block (the CPU default)
    memory     the useful fraction of the KV memory on the three mixes (the real managers,
               :func:`vmkv.bench.memory.run`), per dtype
    engines    both KV modes x both dtypes alternated on the decode-heavy mix (K/V are most of
               its bytes): output tokens/s, step time, map/unmap calls per generated token
    profile    a decode step in parts (``vmkv bench profile``) per mode and dtype
    accuracy   teacher-forced top-1 agreement and perplexity of the int8 cache against the
               model's dtype's (``vmkv bench accuracy``) on the project's own prose

The report's first screen says which dtype ``auto`` picks and why, from these numbers.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

from vmkv.bench import accuracy, memory, profile
from vmkv.bench.study import end_to_end, runs, tax
from vmkv.bench.study.figure import Figure, Section
from vmkv.bench.study.fmt import num
from vmkv.bench.study.memory import mix_lengths
from vmkv.bench.study.scale import GiB, KiB, MiB, Scale
from vmkv.bench.workloads import MIXES
from vmkv.config import CPU_BLOCK_SIZE, HOST_PAGE_SIZE
from vmkv.kv.spec import KVSpec, kv_storage_dtype

NAME, TITLE = "kv_dtype", "The KV dtype (bytes per token)"
MODES = ("virtual", "paged")
KV_DTYPES = ("auto", "int8")
MIX = "decode-heavy"
ENGINE_PAGE = HOST_PAGE_SIZE["per-layer"]
LARGE_PAGE = 2 * MiB
#: teacher-forced positions and chunk length of the accuracy runs per scale
ACCURACY = {"full": (2000, 512), "quick": (1000, 512), "smoke": (30, 32)}


def model_dtype(scale: Scale) -> str:
    """The model's dtype for this part: bfloat16 where the CPU has bf16 hardware (the
    end-to-end part's rule), else float32."""
    return end_to_end.dtypes(scale)[0][-1]


def storage(kv_dtype: str, dtype: str) -> torch.dtype:
    """The cache's storage dtype for ``--kv-cache-dtype kv_dtype`` with a ``dtype`` model."""
    return kv_storage_dtype(dtype if kv_dtype == "auto" else kv_dtype)


def geometry(dtype: torch.dtype) -> dict[str, Any]:
    """Bytes and tokens per unit of memory for the default model's KV shape in ``dtype``."""
    spec = KVSpec(*memory.SMOLLM2_135M, dtype=dtype)
    # a per-layer page holds one layer's K (or V) rows; an all-layers page whole tokens
    return {"bytes_per_token": spec.bytes_per_token,
            "tokens_per_gib": GiB // spec.bytes_per_token,
            "tokens_per_page": ENGINE_PAGE / spec.head_bytes,
            "tokens_per_large_page": LARGE_PAGE / spec.bytes_per_token,
            "block_bytes": CPU_BLOCK_SIZE * spec.bytes_per_token}


def tasks(scale: Scale, raw: dict[str, Any]) -> list[tuple[str, Callable[[], None]]]:
    dtype = model_dtype(scale)
    names = {kv: str(storage(kv, dtype)).removeprefix("torch.") for kv in KV_DTYPES}
    raw.update(model_dtype=dtype, storage=names, mix=MIX, block_size=CPU_BLOCK_SIZE,
               page_size=ENGINE_PAGE, large_page=LARGE_PAGE, profile_batch=scale.profile_batch,
               profile_context=scale.profile_context)

    def layout() -> None:
        raw["geometry"] = {kv: geometry(storage(kv, dtype)) for kv in KV_DTYPES}
        raw["memory"] = {mix: {kv: memory.run(
            mix_lengths(mix, scale.memory_prompts), block_size=CPU_BLOCK_SIZE,
            page_sizes=(ENGINE_PAGE,), layouts=("per-layer",), dtype=storage(kv, dtype))
            for kv in KV_DTYPES} for mix in MIXES}

    def engines() -> None:
        requests, info = runs.mix_workload(scale, MIX)
        configs = {f"{m} {kv}": runs.engine_config(scale, kv_mode=m, dtype=dtype,
                                                   kv_cache_dtype=kv)
                   for m in MODES for kv in KV_DTYPES}
        with runs.built(configs) as made:
            raw["engines"] = {"workload": info, "startup": made["startup"],
                              "runs": runs.alternate(made["engines"], requests,
                                                     repeats=scale.repeats,
                                                     warmup=runs.warmup_requests(
                                                         requests, scale.warmup_prompts))}

    def step(mode: str, kv: str) -> None:
        prefill_batch, prefill_len = scale.profile_prefill
        config = runs.engine_config(scale, kv_mode=mode, dtype=dtype, kv_cache_dtype=kv)
        raw.setdefault("profile", {})[f"{mode} {kv}"] = profile.run(
            config, batch=scale.profile_batch, context=scale.profile_context,
            prefill_batch=prefill_batch, prefill_len=prefill_len,
            repeats=scale.profile_repeats, warmup=1)

    def agreement() -> None:
        positions, chunk = ACCURACY[scale.name]
        raw["accuracy"] = accuracy.run([f"none:{dtype}:int8"], f"none:{dtype}",
                                       positions=positions, chunk=chunk)

    return [("bytes, pages and blocks", layout), (f"engines on {MIX}, alternated", engines),
            *((f"profile {m} {kv}", lambda m=m, kv=kv: step(m, kv))
              for m in MODES for kv in KV_DTYPES),
            ("accuracy", agreement)]


def _useful(result: dict[str, Any], strategy: str) -> float:
    return next(r["useful_pct"] for r in result["rows"] if r["strategy"] == strategy)


def _per_token(runs_: list[dict[str, Any]], field: str) -> float:
    """Median over runs of map + unmap ``field`` (calls or pages) per generated token."""
    return statistics.median(tax.op_totals(r, "map", "unmap")[field] / r["output_tokens"]
                             for r in runs_)


def summarise(raw: dict[str, Any], scale: Scale) -> dict[str, Any]:
    geo = raw["geometry"]
    out: dict[str, Any] = {
        "model_dtype": raw["model_dtype"], "storage": raw["storage"], "geometry": geo,
        "tokens_ratio": geo["int8"]["tokens_per_gib"] / geo["auto"]["tokens_per_gib"],
        "useful_pct": {mix: {kv: {"paged": _useful(r, "paged"),
                                  "virtual": _useful(r, "virtual")} for kv, r in per.items()}
                       for mix, per in raw["memory"].items()},
        "engines": {}, "decode": {}}
    for name in raw["engines"]["startup"]:
        mine = [r for r in raw["engines"]["runs"] if r["mode"] == name]
        out["engines"][name] = {
            "output_tokens_per_s": statistics.median(r["output_tokens_per_s"] for r in mine),
            "step_ms": statistics.median(1e3 * r["elapsed_s"] / r["steps"] for r in mine),
            "map_calls_per_token": _per_token(mine, "calls"),
            "pages_per_token": _per_token(mine, "pages")}
    for name, result in raw.get("profile", {}).items():
        phase = next(p for p in result["phases"] if p["phase"] == "decode")
        out["decode"][name] = {"step_ms": phase["step_ms"], "attention_ms": phase["attention"]}
    e, d = out["engines"], out["decode"]
    out["speedup"] = {m: e[f"{m} int8"]["output_tokens_per_s"]
                      / e[f"{m} auto"]["output_tokens_per_s"] for m in MODES}
    out["decode_step_ratio"] = {m: d[f"{m} int8"]["step_ms"] / d[f"{m} auto"]["step_ms"]
                                for m in MODES if f"{m} int8" in d and f"{m} auto" in d}
    row = next(r for r in raw["accuracy"]["rows"] if r["variant"].endswith(":int8"))
    out["accuracy"] = {"positions": row["positions"], "agreement_pct": 100 * row["agreement"],
                       "ppl_ratio": row["ppl_ratio"]}
    return out


def auto_sentence(s: dict[str, Any]) -> str:
    """The first screen's line: what ``auto`` picks and why, in this part's numbers."""
    geo, acc = s["geometry"], s["accuracy"]
    speed = ", ".join(f"{num(v)}x {m}" for m, v in s["speedup"].items())
    return (f"**The KV dtype**: `--kv-cache-dtype auto` keeps the model's dtype "
            f"({s['storage']['auto']} here, {num(geo['auto']['bytes_per_token'])} bytes a "
            f"token). int8 takes {num(geo['int8']['bytes_per_token'])} bytes "
            f"({num(s['tokens_ratio'])}x the tokens per GiB and per page) and runs the "
            f"{MIX} mix at {speed} auto's output tokens/s; its top-1 tokens agree with the "
            f"model's cache at {num(acc['agreement_pct'])} % of {num(acc['positions'])} "
            f"teacher-forced positions (perplexity ratio {num(acc['ppl_ratio'])}). auto never "
            "picks it: int8 rounds every K/V value, so it is the user's choice where memory "
            "binds (part 8).")


def _draw(s: dict[str, Any]) -> Callable[[str], None]:
    def draw(path: str) -> None:
        from vmkv.bench.plots import pyplot, save

        fig, (ax1, ax2) = pyplot().subplots(1, 2, figsize=(11, 3.8))
        names = list(s["engines"])
        ax1.bar(names, [s["engines"][n]["output_tokens_per_s"] for n in names])
        ax1.set(ylabel=f"output tokens/s, {MIX} (median)")
        ax1.tick_params(axis="x", labelsize=7)
        steps = list(s["decode"])
        ax2.bar(steps, [s["decode"][n]["step_ms"] for n in steps], label="decode step")
        ax2.bar(steps, [s["decode"][n]["attention_ms"] for n in steps], label="attention")
        ax2.set(ylabel="ms")
        ax2.tick_params(axis="x", labelsize=7)
        ax2.legend(fontsize="small")
        save(fig, path)

    return draw


def section(doc: dict[str, Any], study: dict[str, Any]) -> Section:
    raw, s, cmd = doc["raw"], doc["summary"], doc["commands"]
    geo = s["geometry"]
    bytes_fig = Figure(
        name="kv-dtype-geometry",
        question="How many tokens does a page, a block and a GiB hold in each KV dtype?",
        columns=["--kv-cache-dtype", "stored as", "bytes/token", "tokens/GiB",
                 f"tokens per {num(raw['page_size'] // KiB)} KiB per-layer page",
                 f"tokens per {num(raw['large_page'] // MiB)} MiB all-layers page",
                 f"bytes per {num(raw['block_size'])}-token block"],
        rows=[[kv, s["storage"][kv], g["bytes_per_token"], g["tokens_per_gib"],
               g["tokens_per_page"], g["tokens_per_large_page"], g["block_bytes"]]
              for kv, g in geo.items()],
        command=cmd["layout"], draw=None,
        notes=["SmolLM2-135M's KV (30 layers, 3 KV heads of 64); int8 rows carry a float16 "
               "scale per token and head, so a page or block still maps whole tokens."])
    mixes = list(s["useful_pct"])
    memory_fig = Figure(
        name="kv-dtype-memory",
        question="Does a smaller token change how much of the KV memory is useful?",
        columns=["--kv-cache-dtype", *(f"{m} {st} %" for m in mixes
                                       for st in ("paged", "virtual"))],
        rows=[[kv, *(s["useful_pct"][m][kv][st] for m in mixes
                     for st in ("paged", "virtual"))] for kv in KV_DTYPES],
        command=cmd["layout"], draw=None,
        notes=[f"Final lengths of each mix's requests; paged {num(raw['block_size'])}-token "
               f"blocks, virtual per-layer {num(raw['page_size'] // KiB)} KiB pages: more "
               "tokens per page leave more of the last page unused."])
    w = raw["engines"]["workload"]
    speed_fig = Figure(
        name="kv-dtype-speed",
        question=f"How fast does each KV dtype serve the {MIX} mix, and how often does "
                 "virtual mode map?",
        columns=["engine", "out tok/s", "step ms", "map+unmap calls per generated token",
                 "pages mapped+unmapped per generated token", "decode step ms (profile)",
                 "decode attention ms (profile)"],
        rows=[[n, v["output_tokens_per_s"], v["step_ms"], v["map_calls_per_token"],
               v["pages_per_token"], *(s["decode"].get(n, {}).get(k) for k in (
                   "step_ms", "attention_ms"))] for n, v in s["engines"].items()],
        command=cmd["engines"], draw=_draw(s),
        notes=[f"{raw['model_dtype']} model, {num(w['num_requests'])} requests "
               f"({num(w['input_tokens'])} prompt, {num(w['output_tokens'])} output tokens), "
               "medians of alternated repetitions; the profile's decode step: "
               f"{num(raw['profile_batch'])} requests at "
               f"{num(raw['profile_context'])} tokens of context. Virtual mode maps pages "
               "only when a request outgrows what its slot already holds (idle slots are "
               "mapped at start-up), so a smaller token maps less often."])
    acc = s["accuracy"]
    reading = [auto_sentence(s) + " int8 / auto output tokens/s: "
               + ", ".join(f"{m} {num(v)}x" for m, v in s["speedup"].items())
               + "; decode step (profile) int8 / auto: "
               + ", ".join(f"{m} {num(v)}x" for m, v in s["decode_step_ratio"].items())
               + f"; agreement {num(acc['agreement_pct'])} %."]
    return Section(TITLE, reading, [bytes_fig, memory_fig, speed_fig])


def commands(scale: Scale, study: str) -> dict[str, str]:
    positions, chunk = ACCURACY[scale.name]
    return {"layout": f"{study}  (alone: vmkv bench memory --page-sizes 16K --block-size "
                      f"{CPU_BLOCK_SIZE} --dtype int8|bfloat16)",
            "engines": f"{study}  (one engine alone: vmkv bench throughput --kv-mode "
                       f"virtual|paged --kv-cache-dtype auto|int8; accuracy: vmkv bench "
                       f"accuracy --kv-cache-dtype int8 --positions {positions} --chunk "
                       f"{chunk})"}
