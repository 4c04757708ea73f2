"""Part 5, end to end: virtual vs paged on the three mixes (prompt-heavy, balanced,
decode-heavy) in every dtype this machine runs fast (float32; bfloat16 where the CPU has
bfloat16 hardware), offline (``bench throughput``'s runs, alternated); the prefix cache off and
on over a shared-prefix workload; and online (``bench serve --launch``) at two request rates:
half the offline capacity and everything at once."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any

from vmkv.bench import serve, throughput
from vmkv.bench.common import workload_for_model
from vmkv.bench.launch import LaunchedServer
from vmkv.bench.study import runs
from vmkv.bench.study.figure import Figure, Section
from vmkv.bench.study.fmt import num
from vmkv.bench.study.scale import Scale
from vmkv.bench.workloads import MIXES, WorkloadSpec
from vmkv.cpu_info import bf16_hardware

NAME, TITLE = "end_to_end", "End to end"
MODES = ("virtual", "paged")
PARITY = 0.01  # |virtual/paged - 1| below this: "at parity"


def dtypes(scale: Scale) -> tuple[list[str], str]:
    """The dtypes to run and why: float32 everywhere, bfloat16 too on bf16 hardware."""
    flags = bf16_hardware()
    if not scale.bf16:
        return ["float32"], "float32 only at this scale"
    if flags:
        return ["float32", "bfloat16"], f"bfloat16 hardware ({', '.join(flags)})"
    return ["float32"], "no bfloat16 hardware (amx_bf16 or avx512_bf16): bfloat16 is emulated"


def tasks(scale: Scale, raw: dict[str, Any]) -> list[tuple[str, Callable[[], None]]]:
    chosen, why = dtypes(scale)
    raw.update(dtypes=chosen, dtype_reason=why)

    def offline(dtype: str) -> None:
        configs = {m: runs.engine_config(scale, kv_mode=m, dtype=dtype) for m in MODES}
        done = raw.setdefault("offline", {}).setdefault(dtype, {})
        with runs.built(configs) as made:
            for mix in MIXES:
                requests, info = runs.mix_workload(scale, mix)
                done[mix] = {"workload": info, "startup": made["startup"], "runs": runs.alternate(
                    made["engines"], requests, repeats=scale.repeats,
                    warmup=runs.warmup_requests(requests, scale.warmup_prompts))}

    def prefix() -> None:
        _, output = scale.mix("balanced")
        spec = WorkloadSpec("shared-prefix", num_prompts=scale.prefix_prompts,
                            prefix_len=scale.prefix_len,
                            input_len=(max(1, scale.prefix_len // 16), scale.prefix_len // 4),
                            output_len=output, seed=runs.SEED)
        requests, info = workload_for_model(spec, None)
        configs = {m + suffix: runs.engine_config(scale, kv_mode=m,
                                                  enable_prefix_caching=bool(suffix))
                   for m in MODES for suffix in ("", throughput.PREFIX_SUFFIX)}
        with runs.built(configs) as made:
            raw["prefix"] = {"workload": info, "runs": runs.alternate(
                made["engines"], requests, repeats=scale.repeats,
                warmup=runs.warmup_requests(requests, scale.warmup_prompts))}

    def online() -> None:
        from vmkv.models import load_tokenizer, resolve_model

        requests, info = runs.mix_workload(scale, "balanced", scale.serve_prompts)
        capacity = _capacity(raw)
        rates = [float(f"{capacity / 2:.2g}"), math.inf]
        tokenizer = load_tokenizer(resolve_model(None, progress=False))
        result: dict[str, Any] = {"workload": info, "capacity_requests_per_s": capacity,
                                  "rates": rates, "modes": {}}
        for mode in MODES:
            argv = ["--kv-mode", mode, "--dtype", "float32", "--kv-cache-memory",
                    str(scale.kv_cache_memory), "--seed", str(runs.SEED)]
            with LaunchedServer(argv) as srv:
                target = serve.ServeTarget(srv.base_url, serve.first_model(srv.base_url))
                result["modes"][mode] = {"server_startup_s": srv.startup_s, "runs": [
                    serve.run(target, requests, request_rate=rate, seed=runs.SEED,
                              tokenizer=tokenizer, progress=False) for rate in rates]}
        raw["online"] = result

    return ([(f"offline {d}", lambda d=d: offline(d)) for d in chosen]
            + [("prefix cache off/on", prefix), ("online", online)])


def _capacity(raw: dict[str, Any]) -> float:
    """Requests/s of float32 virtual on the balanced mix offline (the online rates' scale)."""
    done = raw.get("offline", {}).get("float32", {}).get("balanced")
    if not done:
        return 1.0
    return statistics.median(r["requests_per_s"] for r in done["runs"]
                             if r["mode"] == "virtual")


def verdict(ratio: float) -> str:
    if abs(ratio - 1) < PARITY:
        return "at parity with"
    return "faster than" if ratio > 1 else "slower than"


def summarise(raw: dict[str, Any], scale: Scale) -> dict[str, Any]:
    offline: dict[str, Any] = {}
    for dtype, mixes in raw["offline"].items():
        for mix, done in mixes.items():
            s = throughput.summarise_runs(done["runs"])
            ttft = {m: statistics.median(r["mean_ttft_s"] for r in done["runs"]
                                         if r["mode"] == m) for m in MODES}
            offline[f"{mix}, {dtype}"] = {
                "mix": mix, "dtype": dtype, "ratios": s["ratios"],
                "ratio_median": s["ratio_median"],
                **{f"{m}_output_tokens_per_s": s["summary"][m]["output_tokens_per_s"]
                   for m in MODES},
                **{f"{m}_mean_ttft_s": ttft[m] for m in MODES},
                "virtual_map_stall_s": s["summary"]["virtual"]["map_stall_s"],
                "preemptions": {m: s["summary"][m]["preemptions"] for m in MODES}}
    medians = [o["ratio_median"] for o in offline.values()]
    overall = statistics.median(medians)
    prefix = throughput.summarise_runs(raw["prefix"]["runs"])
    online = raw["online"]
    rates = {}
    for i, rate in enumerate(online["rates"]):
        per = {m: online["modes"][m]["runs"][i] for m in MODES}
        rates[str(rate)] = {
            "rate": rate,
            **{f"{m}_{k}": per[m][k] for m in MODES for k in (
                "output_throughput", "mean_ttft_ms", "mean_tpot_ms", "p99_ttft_ms",
                "completed", "failed")},
            "ratio": per["virtual"]["output_throughput"] / per["paged"]["output_throughput"]}
    return {
        "offline": offline, "ratio_median": overall, "ratio_min": min(medians),
        "ratio_max": max(medians), "runs_compared": len(medians), "verdict": verdict(overall),
        "difference_pct": abs(overall - 1) * 100, "parity_pct": PARITY * 100,
        "prefix": {"ratio_median": prefix.get("prefix_ratio_median", {}),
                   "ratios": prefix.get("prefix_ratios", {}),
                   "output_tokens_per_s": {m: v["output_tokens_per_s"]
                                           for m, v in prefix["summary"].items()},
                   "cached_prompt_tokens": {m: statistics.median(
                       r["cached_prompt_tokens"] for r in raw["prefix"]["runs"]
                       if r["mode"] == m) for m in prefix["summary"]}},
        "online": rates,
    }


def _draw_offline(offline: dict[str, Any]) -> Callable[[str], None]:
    def draw(path: str) -> None:
        from vmkv.bench.plots import MODE_COLORS, pyplot, save

        names = list(offline)
        fig, (ax1, ax2) = pyplot().subplots(1, 2, figsize=(11, 3.8))
        width = 0.4
        for i, m in enumerate(MODES):
            ax1.bar([j + i * width for j in range(len(names))],
                    [offline[n][f"{m}_output_tokens_per_s"] for n in names], width, label=m,
                    color=MODE_COLORS[m])
        ax1.set_xticks([j + width / 2 for j in range(len(names))], names, fontsize=7,
                       rotation=20)
        ax1.set(ylabel="output tokens/s (median)")
        ax1.legend(fontsize="small")
        for j, n in enumerate(names):
            ax2.plot([j] * len(offline[n]["ratios"]), offline[n]["ratios"], "o", color="gray")
            ax2.plot([j], [offline[n]["ratio_median"]], "D", color="k")
        ax2.axhline(1.0, color="k", lw=0.8)
        ax2.set_xticks(range(len(names)), names, fontsize=7, rotation=20)
        ax2.set(ylabel="virtual / paged (repetitions, median)")
        save(fig, path)

    return draw


def _draw_online(online: dict[str, Any]) -> Callable[[str], None]:
    def draw(path: str) -> None:
        from vmkv.bench.plots import MODE_COLORS, pyplot, save

        fig, axes = pyplot().subplots(1, 3, figsize=(11, 3.2))
        rates = list(online)
        for ax, key, label in zip(axes, ("output_throughput", "mean_ttft_ms", "mean_tpot_ms"),
                                  ("output tokens/s", "mean TTFT ms", "mean TPOT ms"),
                                  strict=True):
            for i, m in enumerate(MODES):
                ax.bar([j + i * 0.4 for j in range(len(rates))],
                       [online[r][f"{m}_{key}"] for r in rates], 0.4, label=m,
                       color=MODE_COLORS[m])
            ax.set_xticks([j + 0.2 for j in range(len(rates))], [f"rate {r}" for r in rates])
            ax.set(ylabel=label)
        axes[0].legend(fontsize="small")
        save(fig, path)

    return draw


def section(doc: dict[str, Any], study: dict[str, Any]) -> Section:
    raw, s, cmd = doc["raw"], doc["summary"], doc["commands"]
    offline = s["offline"]
    first = next(iter(raw["offline"].values()))
    count = next(iter(first.values()))["workload"]["num_requests"]
    mixes = ", ".join(f"{m} (prompts U[{num(d['workload']['input_len_arg'][0])}, "
                      f"{num(d['workload']['input_len_arg'][1])}], outputs "
                      f"U[{num(d['workload']['output_len_arg'][0])}, "
                      f"{num(d['workload']['output_len_arg'][1])}])" for m, d in first.items())
    off_fig = Figure(
        name="e2e-offline",
        question="Offline, all requests queued at once: is virtual faster or slower than paged "
                 "on each mix and dtype?",
        columns=["mix, dtype", "virtual out tok/s", "paged out tok/s", "virtual / paged per "
                 "repetition", "median", "virtual map+create s", "mean TTFT s virtual / paged"],
        rows=[[n, o["virtual_output_tokens_per_s"], o["paged_output_tokens_per_s"],
               ", ".join(num(r) for r in o["ratios"]), o["ratio_median"],
               o["virtual_map_stall_s"],
               f"{num(o['virtual_mean_ttft_s'])} / {num(o['paged_mean_ttft_s'])}"]
              for n, o in offline.items()],
        command=cmd["offline"], draw=_draw_offline(offline),
        notes=[f"Mixes (random token ids, seed 0, {num(count)} requests each, greedy, exact "
               f"output lengths): {mixes}. Dtypes: "
               f"{', '.join(raw['dtypes'])} ({raw['dtype_reason']})."])
    p = s["prefix"]
    pw = raw["prefix"]["workload"]
    prefix_fig = Figure(
        name="e2e-prefix",
        question="With a shared prefix, what does the prefix cache gain in each mode?",
        columns=["engine", "out tok/s", "prompt tokens from the cache"],
        rows=[[m, v, p["cached_prompt_tokens"][m]] for m, v in p["output_tokens_per_s"].items()],
        command=cmd["prefix"], draw=None,
        notes=[f"{num(pw['num_requests'])} requests = one {num(pw['prefix_len'])}-token prefix "
               f"+ U[{num(pw['input_len_arg'][0])}, {num(pw['input_len_arg'][1])}] own tokens, "
               f"outputs U[{num(pw['output_len_arg'][0])}, {num(pw['output_len_arg'][1])}]. "
               "Cache on / off: " + ", ".join(f"{m} {num(v)}×" for m, v in
                                              p["ratio_median"].items()) + "."])
    on = s["online"]
    online_fig = Figure(
        name="e2e-online",
        question="Online, through the HTTP server, at half the offline capacity and with "
                 "everything at once: how do the two modes compare?",
        columns=["rate req/s", "virtual out tok/s", "paged out tok/s", "virtual / paged",
                 "TTFT ms virtual / paged", "TPOT ms virtual / paged",
                 "completed / failed: virtual, paged"],
        rows=[[v["rate"], v["virtual_output_throughput"], v["paged_output_throughput"],
               v["ratio"], f"{num(v['virtual_mean_ttft_ms'])} / {num(v['paged_mean_ttft_ms'])}",
               f"{num(v['virtual_mean_tpot_ms'])} / {num(v['paged_mean_tpot_ms'])}",
               f"{num(v['virtual_completed'])} / {num(v['virtual_failed'])}, "
               f"{num(v['paged_completed'])} / {num(v['paged_failed'])}"]
              for v in on.values()],
        command=cmd["online"], draw=_draw_online(on),
        notes=[f"The balanced mix, {num(raw['online']['workload']['num_requests'])} requests, "
               f"float32; offline capacity {num(raw['online']['capacity_requests_per_s'])} "
               "requests/s (virtual, float32, balanced)."])
    reading = [f"Virtual is **{s['verdict']} paged** here: virtual / paged output tokens/s "
               f"{num(s['ratio_median'])} (median over {num(s['runs_compared'])} mix × dtype "
               f"medians, from {num(s['ratio_min'])} to {num(s['ratio_max'])})."]
    return Section(TITLE, reading, [off_fig, prefix_fig, online_fig])


def commands(scale: Scale, study: str) -> dict[str, str]:
    n = scale.num_prompts
    return {
        "offline": f"{study}  (one mix alone: vmkv bench throughput --kv-mode both --dtype D "
                   f"--workload random --num-prompts {n} --input-len LO:HI --output-len LO:HI "
                   f"--repeats {scale.repeats} --kv-cache-memory {scale.kv_cache_memory})",
        "prefix": f"{study}  (alone: vmkv bench throughput --kv-mode both "
                  f"--compare-prefix-caching --workload shared-prefix --prefix-len "
                  f"{scale.prefix_len} --num-prompts {scale.prefix_prompts})",
        "online": f"{study}  (alone: vmkv bench serve --launch --kv-mode virtual|paged --dtype "
                  f"float32 --num-prompts {scale.serve_prompts} --request-rate R,inf)"}
