"""Part 6, elastic memory: what the operating system holds for each mode through bursts of
requests and idle gaps (:mod:`vmkv.bench.elastic`: a real ``vmkv serve`` per mode, sampled from
outside): RSS and its shared part, the KV pool memfd, next to the live KV bytes. Virtual mode
runs with ``--max-idle-memory`` and returns idle pages as requests finish; paged mode
allocates its block pool at start-up."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from vmkv.bench import elastic
from vmkv.bench.study.figure import Figure, Section
from vmkv.bench.study.fmt import num
from vmkv.bench.study.scale import MiB, Scale

NAME, TITLE = "elastic", "Elastic memory"
MAX_IDLE_MEMORY = 64 * MiB
MODES = ("virtual", "paged")


def serve_args(mode: str, scale: Scale) -> list[str]:
    argv = ["--kv-mode", mode, "--dtype", "float32", "--kv-cache-memory",
            str(scale.kv_cache_memory), "--max-model-len", "1024", "--max-num-seqs", "64"]
    return argv + (["--max-idle-memory", str(MAX_IDLE_MEMORY)] if mode == "virtual" else [])


def tasks(scale: Scale, raw: dict[str, Any]) -> list[tuple[str, Callable[[], None]]]:
    trace = elastic.BurstTrace(scale.elastic_bursts, scale.elastic_idle_s,
                               scale.elastic_max_tokens, scale.elastic_words)
    raw.update(trace=asdict(trace), kv_cache_memory=scale.kv_cache_memory,
               max_idle_memory=MAX_IDLE_MEMORY, modes={})

    def one(mode: str) -> None:
        raw["modes"][mode] = {"mode": mode, "serve_args": serve_args(mode, scale),
                              **elastic.run_mode(serve_args(mode, scale), trace, interval=0.5)}

    return [(mode, lambda m=mode: one(m)) for mode in MODES]


def _at_gap_ends(run: dict[str, Any], idle_s: float) -> list[dict[str, Any]]:
    ends = []
    for b in run["bursts"]:
        gap = [r for r in run["rows"] if b["end_s"] < r["t"] <= b["end_s"] + idle_s]
        ends.append(max(gap, key=lambda r: r["t"]) if gap else None)
    return ends


def summarise(raw: dict[str, Any], scale: Scale) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode, run in raw["modes"].items():
        rows = run["rows"]
        ends = _at_gap_ends(run, raw["trace"]["idle_s"])
        out[mode] = {
            "peak_rss": max(r["rss"] for r in rows),
            "peak_rss_shmem": max(r["rss_shmem"] for r in rows),
            "peak_memfd": max(r["memfd"] for r in rows),
            "peak_kv_in_use": max(r.get("in_use", 0) for r in rows),
            "idle_rss": [e["rss"] if e else None for e in ends],
            "idle_rss_shmem": [e["rss_shmem"] if e else None for e in ends],
            "idle_memfd": [e["memfd"] if e else None for e in ends],
            "pool_allocated_at_end": rows[-1].get("allocated"),
            "requests_ok": sum(b["statuses"].get("200", 0) for b in run["bursts"]),
            "requests": sum(b["requests"] for b in run["bursts"])}
    return out


def _draw_os(runs: dict[str, Any]) -> Callable[[str], None]:
    def draw(path: str) -> None:
        from vmkv.bench.plots import MODE_COLORS, pyplot, save

        fig, (ax1, ax2) = pyplot().subplots(1, 2, figsize=(11, 3.6))
        for mode, run in runs.items():
            t = [r["t"] for r in run["rows"]]
            color = MODE_COLORS[mode]
            ax1.plot(t, [r["rss"] / MiB for r in run["rows"]], color=color, label=f"{mode} RSS")
            ax2.plot(t, [r["rss_shmem"] / MiB for r in run["rows"]], color=color,
                     label=f"{mode} RssShmem")
            ax2.plot(t, [r["memfd"] / MiB for r in run["rows"]], ":", color=color,
                     label=f"{mode} pool memfd")
            for b in run["bursts"]:
                ax1.axvspan(b["start_s"], b["end_s"], color=color, alpha=0.08)
        ax1.set(xlabel="s", ylabel="MiB", title="process RSS")
        ax2.set(xlabel="s", ylabel="MiB", title="shared memory: mapped (RssShmem) and pool")
        ax1.legend(fontsize=7)
        ax2.legend(fontsize=7)
        save(fig, path)

    return draw


def section(doc: dict[str, Any], study: dict[str, Any]) -> Section:
    raw, s, cmd = doc["raw"], doc["summary"], doc["commands"]
    runs = raw["modes"]
    trace = raw["trace"]
    os_fig = Figure(
        name="elastic-os-memory",
        question="How much memory does the operating system see each mode hold through bursts "
                 "and idle gaps?",
        columns=["mode", "requests ok", "peak RSS", "peak RssShmem", "peak pool memfd",
                 "RSS at the end of each idle gap", "pool memfd at the end of each idle gap"],
        rows=[[m, f"{num(v['requests_ok'])} / {num(v['requests'])}", v["peak_rss"],
               v["peak_rss_shmem"], v["peak_memfd"],
               ", ".join(num(x) for x in v["idle_rss"]),
               ", ".join(num(x) for x in v["idle_memfd"])] for m, v in s.items()],
        command=cmd["trace"], draw=_draw_os(runs),
        notes=[f"Bytes. Bursts of {', '.join(num(b) for b in trace['bursts'])} concurrent "
               f"requests ({num(trace['max_tokens'])} new tokens each), "
               f"{num(trace['idle_s'])} s idle after each; KV budget "
               f"{num(raw['kv_cache_memory'])} bytes; virtual with --max-idle-memory "
               f"{num(raw['max_idle_memory'])}. Paged mode's block pool is anonymous memory "
               "(in RSS, not in a memfd); virtual mode's pool is a memfd (RssShmem: what the "
               "process has mapped; memfd: what the pool holds)."])
    pool_fig = Figure(
        name="elastic-kv-pool",
        question="Does the KV pool follow the live KV bytes, or stay at its start-up size?",
        columns=["mode", "peak live KV bytes", "pool bytes allocated at the end"],
        rows=[[m, v["peak_kv_in_use"], v["pool_allocated_at_end"]] for m, v in s.items()],
        command=cmd["trace"],
        draw=lambda path: elastic.plot(
            list(runs.values()), path, kv_cache_memory=raw["kv_cache_memory"],
            max_idle_memory=raw["max_idle_memory"], title="KV memory over the burst trace"))
    reading = []
    if set(MODES) <= s.keys():
        v, p = s["virtual"], s["paged"]
        reading.append(f"At the end of the last idle gap the virtual server's RSS is "
                       f"{num(v['idle_rss'][-1])} bytes against {num(p['idle_rss'][-1])} "
                       f"for paged; its pool memfd holds {num(v['idle_memfd'][-1])} bytes "
                       f"(peak {num(v['peak_memfd'])}).")
    return Section(TITLE, reading, [os_fig, pool_fig])


def commands(scale: Scale, study: str) -> dict[str, str]:
    bursts = ",".join(map(str, scale.elastic_bursts))
    return {"trace": f"{study}  (similar alone: python benchmarks/elastic_memory.py --bursts "
                     f"{bursts} --idle {scale.elastic_idle_s} --max-tokens "
                     f"{scale.elastic_max_tokens})"}
