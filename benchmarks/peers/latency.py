"""One user: time per output token and time to first token, vmkv against llama.cpp on the same
GGUF file, alternated, each run in a fresh process.

    python benchmarks/peers/latency.py --out DIR [--engines vmkv-gguf,vmkv-none-bf16,llama.cpp]
        [--prompt-len 256] [--output-len 256] [--repeats 5] [--threads 2]
        [--lock /tmp/vmkv-bench.lock]

Engines:
  vmkv-QUANT[-DTYPE[-KV]]  vmkv's engine in this process's venv (``--quantization QUANT``,
                      ``--dtype DTYPE``, ``--kv-cache-dtype KV``, default auto; e.g.
                      vmkv-gguf-auto-int8): the request added to an ``LLMEngine`` and stepped
                      until done; TTFT = first output token - add, TPOT = (last - first) /
                      (n - 1), both from the engine's own clock (no HTTP)
  llama.cpp           ``llama-server`` of the native build (``llama_cpp.sh``) on the default
                      model's GGUF file, ``--parallel 1``, the request's own ``timings`` (also
                      measured inside the engine): TTFT = prompt_ms, TPOT =
                      predicted_per_token_ms
  read-bandwidth      not an engine: the machine's read bandwidth as ``vmkv bench profile``
                      measures it (a sum over 256 MiB, the same threads), run in the rotation
                      (default on), so each vmkv engine's TPOT is stated against its weights'
                      memory floor in the same sitting: floor = resident weight bytes / median
                      read bandwidth
Every engine gets the same random prompt (token ids, fixed seed), greedy, ``ignore_eos``,
exactly ``--output-len`` tokens, the same threads, one warm-up request first. Repetitions rotate
the engines' order. Writes ``latency.json`` (every run, medians, vmkv / llama.cpp ratios, the
CPU and its flags, each engine's weight format, the floors) under ``--out``. ``--lock``: each
run holds an exclusive flock on that file (a shared machine's benchmark lock).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from peer_result import RESULT_PREFIX, print_result  # noqa: E402

LLAMA_BIN = Path(os.environ.get("LLAMA_CPP_BIN", "")) if os.environ.get("LLAMA_CPP_BIN") else None


def prompt_ids(n: int, vocab: int = 49152, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def run_vmkv(spec: str, prompt: list[int], output_len: int) -> dict[str, Any]:
    """One request through vmkv's engine (``spec``: vmkv-QUANT[-DTYPE[-KV]]); the process tuned
    first (:func:`main`)."""
    from vmkv.config import EngineConfig
    from vmkv.engine.llm_engine import LLMEngine
    from vmkv.sampling_params import RequestOutputKind, SamplingParams

    _, quant, *rest = spec.split("-")
    dtype, kv = (*rest, "auto", "auto")[:2]
    config = EngineConfig(quantization=quant, dtype=dtype, kv_cache_dtype=kv,
                          max_model_len=len(prompt) + output_len + 8, max_num_seqs=4,
                          enable_prefix_caching=False)
    engine = LLMEngine(config)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)  # each step's new tokens

    def one(rid: str) -> tuple[float, float, int]:
        added = time.perf_counter()
        engine.add_request(rid, prompt, params)
        first = last = 0.0
        n = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                now = time.perf_counter()
                got = len(out.outputs[0].token_ids) if out.outputs else 0
                if got and not n:
                    first = now
                n += got
                last = now
        return first - added, (last - first) / max(1, n - 1), n

    one("warm-up")
    ttft, tpot, n = one("timed")
    weights = next((line for line in engine.executor.describe() if line.startswith("weights:")),
                   "")
    engine.close()
    return {"ttft_ms": ttft * 1e3, "tpot_ms": tpot * 1e3, "output_tokens": n,
            "weights": weights, "dtype": config.dtype_choice[0]}


def run_read_bandwidth() -> dict[str, Any]:
    """The machine's read bandwidth, as ``vmkv bench profile`` measures it (bytes/s)."""
    from vmkv.bench.profile import machine_rates

    return {"read_bytes_per_s": machine_rates("torch")["read_bytes_per_s"]}


def resident_bytes(weights: str) -> float | None:
    """The bytes of a ``weights: ..., N MB resident`` line (None without one)."""
    found = re.search(r"([0-9.]+) MB resident", weights)
    return float(found.group(1)) * 1e6 if found else None


def floors(runs: list[dict[str, Any]], medians: dict[str, dict[str, float]]
           ) -> dict[str, dict[str, float]]:
    """Each vmkv engine's memory floor (resident weight bytes / median read bandwidth) and its
    median TPOT over it."""
    bandwidth = [r["read_bytes_per_s"] for r in runs if r["engine"] == BANDWIDTH]
    if not bandwidth:
        return {}
    bw = statistics.median(bandwidth)
    out = {}
    for engine, med in medians.items():
        sizes = [resident_bytes(r.get("weights", "")) for r in runs if r["engine"] == engine]
        if sizes and sizes[0]:
            floor_ms = sizes[0] / bw * 1e3
            out[engine] = {"read_gb_per_s": bw / 1e9, "weight_mb": sizes[0] / 1e6,
                           "floor_ms": floor_ms, "tpot_over_floor": med["tpot_ms"] / floor_ms}
    return out


class held:
    """An exclusive flock on ``path`` while in the block (no-op for None)."""

    def __init__(self, path: str | None) -> None:
        self.path, self.file = path, None

    def __enter__(self) -> None:
        if self.path is not None:
            self.file = open(self.path, "a")  # noqa: SIM115 - released in __exit__
            fcntl.flock(self.file, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        if self.file is not None:
            fcntl.flock(self.file, fcntl.LOCK_UN)
            self.file.close()


BANDWIDTH = "read-bandwidth"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_llama_cpp(gguf: str, prompt: list[int], output_len: int, threads: int) -> dict[str, Any]:
    """One request through a native llama-server (its own timings)."""
    if LLAMA_BIN is None:
        raise SystemExit("set LLAMA_CPP_BIN (source llama_cpp.sh; ensure_llama_cpp)")
    port = _free_port()
    server = subprocess.Popen(
        [str(LLAMA_BIN / "llama-server"), "-m", gguf, "-t", str(threads), "-tb", str(threads),
         "-c", str(len(prompt) + output_len + 64), "--parallel", "1", "--port", str(port),
         "--host", "127.0.0.1", "--no-warmup"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
        body = {"prompt": prompt, "n_predict": output_len, "ignore_eos": True,
                "temperature": 0.0, "cache_prompt": False, "top_k": 1}

        def one() -> dict[str, Any]:
            req = urllib.request.Request(f"{base}/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                return json.loads(r.read())

        one()  # warm-up
        t = one()["timings"]
        return {"ttft_ms": t["prompt_ms"], "tpot_ms": t["predicted_per_token_ms"],
                "output_tokens": t["predicted_n"], "weights": f"GGUF {Path(gguf).name}",
                "dtype": "gguf"}
    finally:
        server.terminate()
        server.wait(timeout=30)


def machine() -> dict[str, Any]:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                  if ln.startswith("model name")), "unknown")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines()
                  if ln.startswith("flags")), [])
    return {"cpu": model, "cpu_count": os.cpu_count(),
            "flags": sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c")))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--engines", default="vmkv-gguf,vmkv-none-bfloat16,llama.cpp")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default="latency-out")
    ap.add_argument("--lock", metavar="PATH", help="hold an exclusive flock on PATH per run")
    ap.add_argument("--no-bandwidth", action="store_true",
                    help="leave the read-bandwidth runs (and the floors) out")
    ap.add_argument("--run", help=argparse.SUPPRESS)  # one engine, in this (fresh) process
    args = ap.parse_args()
    if args.run and args.run != "llama.cpp":
        # before anything imports torch: OpenMP reads its variables once, when torch loads
        # (vmkv's tuning, as `vmkv serve` sets it; the default model's path below loads torch)
        from vmkv.process_tuning import tune_process

        tune_process()
    prompt = prompt_ids(args.prompt_len)
    from_wheel = None
    if args.run or "llama.cpp" in args.engines:
        from vmkv.models.default_model import default_gguf_path

        from_wheel = str(default_gguf_path())
    if args.run:
        if args.run == "llama.cpp":
            print_result(run_llama_cpp(from_wheel, prompt, args.output_len, args.threads))
        elif args.run == BANDWIDTH:
            print_result(run_read_bandwidth())
        else:
            print_result(run_vmkv(args.run, prompt, args.output_len))
        return 0
    engines = args.engines.split(",")
    rotation = engines + ([] if args.no_bandwidth else [BANDWIDTH])
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    runs: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        order = rotation[rep % len(rotation):] + rotation[: rep % len(rotation)]
        for engine in order:
            cmd = [sys.executable, __file__, "--run", engine, "--prompt-len",
                   str(args.prompt_len), "--output-len", str(args.output_len), "--threads",
                   str(args.threads)]
            with held(args.lock):
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            line = next((ln for ln in reversed(proc.stdout.splitlines())
                         if ln.startswith(RESULT_PREFIX)), None)
            if line is None:
                print(proc.stderr[-2000:], file=sys.stderr)
                raise SystemExit(f"{engine} failed (exit {proc.returncode})")
            result = {"engine": engine, "repeat": rep, **json.loads(line[len(RESULT_PREFIX):])}
            runs.append(result)
            if engine == BANDWIDTH:
                print(f"{rep} {engine:24s} {result['read_bytes_per_s'] / 1e9:.1f} GB/s",
                      flush=True)
                continue
            print(f"{rep} {engine:24s} TPOT {result['tpot_ms']:.2f} ms  TTFT "
                  f"{result['ttft_ms']:.1f} ms  ({result['output_tokens']} tokens)", flush=True)
    medians = {e: {k: statistics.median(r[k] for r in runs if r["engine"] == e)
                   for k in ("tpot_ms", "ttft_ms")} for e in engines}
    ratios = {e: {k: medians[e][k] / medians["llama.cpp"][k] for k in ("tpot_ms", "ttft_ms")}
              for e in engines if "llama.cpp" in medians and e != "llama.cpp"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    floor = floors(runs, medians)
    report = {"bench": "latency", "prompt_len": args.prompt_len, "output_len": args.output_len,
              "repeats": args.repeats, "threads": args.threads, "machine": machine(),
              "medians": medians, "ratio_to_llama_cpp": ratios, "memory_floor": floor,
              "runs": runs}
    (out / "latency.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({"medians": medians, "ratio_to_llama_cpp": ratios, "memory_floor": floor},
                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
