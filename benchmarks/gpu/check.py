"""The GPU check: every step in its own process with its own timeout, one summary at the end.

    bash benchmarks/gpu/check.sh                       # default steps, <= 420 s on the H200
    bash benchmarks/gpu/check.sh --steps s3,s4         # rerun some steps
    bash benchmarks/gpu/check.sh --budget 300          # stop starting steps after 300 s
    VMKV_CHECK_DEVICE=cpu bash benchmarks/gpu/check.sh # dry run on CPU (host memory, Triton
                                                       # interpreter, tiny shapes)

Order: the default steps s0 s1 s2 s3 s4 s6 s7 (their timeouts add up to the default budget),
then, only with time left, s5 (benchmark CLI), s10 (tensor parallelism), s11 (sliding-window
attention with the pages behind the window unmapped), s12 (speculative decoding), s13 (fp8 KV
against bf16 at the 8B shapes), s8 (pytest -m gpu, if pytest imports) and s9
(compute-sanitizer, if present). Results go to ``$OUT`` if set
(the device tool brings that folder back), else ``benchmarks/results/gpu-check-<time>/``: one
JSON per step (rewritten after every result), ``logs/<step>.log``, ``summary.json`` (after every
step) and ``summary.txt``. A step that dies (error 700 kills the CUDA context, SIGSEGV, timeout)
is reported as such and the next step starts in a fresh process. Nothing is installed; the
source tree runs from ``PYTHONPATH=.``, and the caller's PYTHONPATH reaches every step."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ON_CPU = os.environ.get("VMKV_CHECK_DEVICE", "cuda") == "cpu"
DEFAULT_BUDGET_S = 420.0


@dataclass
class Step:
    """One step: its command, timeout, and when it runs."""

    name: str
    cmd: list[str]
    timeout: float
    what: str
    optional: bool = False  # after the default steps, only with time left; may be skipped
    min_time: float = 15.0  # do not start with less than this left
    budget_margin: float | None = None  # VMKV_STEP_BUDGET = the timeout it gets minus this
    skip: str | None = None  # why it does not run here


def steps(py: str, env: dict[str, str]) -> list[Step]:
    """Every step in run order. Default timeouts add up to DEFAULT_BUDGET_S (420 s): each pays
    ~5-15 s of imports and CUDA init; s6 and s7 stop starting points when their budget ends."""
    script = lambda name: [py, str(HERE / f"{name}.py")]  # noqa: E731
    sanitizer = shutil.which("compute-sanitizer")
    return [
        Step("s0_env", script("s0_env"), 35, "versions, toolchain, Triton launch, driver"),
        Step("s1_vmm_smoke", script("s1_vmm_smoke"), 30, "VMM + torch + cupy round trip"),
        Step("s2_vmm_latency", script("s2_vmm_latency"), 35, "per-page VMM latency, mapper"),
        Step("s3_attention", script("s3_attention"), 95, "kernels vs fp32 ref, tails unmapped"),
        Step("s4_tokens", script("s4_tokens"), 85, "greedy tokens vs transformers, engine"),
        Step("s6_decode", script("s6_decode"), 85, "8B decode step vs roofline",
             budget_margin=25),
        Step("s7_twins", script("s7_twins"), 55, "Triton + CUDA twins, 8B shapes",
             budget_margin=15),
        Step("s5_bench_cli", script("s5_bench_cli"), 150, "vmkv bench throughput / kernels",
             optional=True, min_time=60, budget_margin=15),
        Step("s10_tensor_parallel", script("s10_tensor_parallel"), 90,
             "TP=2 over NCCL (>= 2 GPUs; else recorded as not exercised)", optional=True,
             min_time=20),
        Step("s11_sliding_window", script("s11_sliding_window"), 60,
             "sliding-window kernels, pages behind the window unmapped", optional=True,
             min_time=20),
        Step("s12_spec_decode", script("s12_spec_decode"), 45,
             "speculative decoding: verify steps eager, rollback, tokens unchanged",
             optional=True, min_time=20),
        Step("s13_fp8_kv", script("s13_fp8_kv"), 125,
             "fp8 KV vs bf16: 8B-shape correctness, engine tokens, decode step", optional=True,
             min_time=30, budget_margin=15),
        Step("s8_pytest", pytest_command(py, env), 120, "pytest -m gpu", optional=True,
             min_time=30, skip=("skipped: no pytest" if not imports(py, "pytest", env)
                                else "skipped: cpu dry run" if ON_CPU else None)),
        Step("s9_sanitize", [sanitizer or "compute-sanitizer", "--tool", "memcheck",
                             "--error-exitcode", "9", "--print-limit", "20",
                             "--report-api-errors", "no",  # cuda-bindings probes symbols
                             *script("s9_sanitize")],
             90, "memcheck: no access to unmapped VA", optional=True, min_time=45,
             skip=("skipped: no compute-sanitizer" if sanitizer is None
                   else "skipped: cpu dry run" if ON_CPU else None)),
    ]


def imports(py: str, module: str, env: dict[str, str]) -> bool:
    """Whether ``module`` imports in a step's environment."""
    return subprocess.run([py, "-c", f"import {module}"], env=env,
                          capture_output=True).returncode == 0


def pytest_command(py: str, env: dict[str, str]) -> list[str]:
    """``pytest -m gpu`` over the test files that hold ``gpu`` tests (with a per-test timeout
    where pytest-timeout imports). Only those files: the others import the server stack
    (openai, fastapi, jsonschema...), which the GPU machine does not have."""
    files = [str(p) for p in sorted((ROOT / "tests").glob("test_*.py"))
             if "mark.gpu" in p.read_text()]
    cmd = [py, "-m", "pytest", "-m", "gpu", "-q", "--tb=short", "-p", "no:cacheprovider",
           "--continue-on-collection-errors", "-rfEs", *files]
    if imports(py, "pytest_timeout", env):
        cmd += ["--timeout", "120"]
    return cmd


def run_one(step: Step, out: Path, timeout: float, env: dict[str, str]) -> dict:
    """Run one step under ``timeout``; its summary row (status, seconds, checks, headline)."""
    log = out / "logs" / f"{step.name}.log"
    if step.budget_margin is not None:
        env = {**env, "VMKV_STEP_BUDGET": str(max(5.0, timeout - step.budget_margin))}
    start = time.monotonic()
    print(f"\n=== {step.name}: {step.what} (timeout {timeout:.0f} s)", flush=True)
    with log.open("w") as f:
        proc = subprocess.Popen(step.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                cwd=ROOT, env=env, start_new_session=True,
                                text=True, bufsize=1)

        def pump() -> None:  # echo live and keep a log, without blocking the timeout
            assert proc.stdout is not None
            for line in proc.stdout:
                f.write(line)
                if len(line) < 400:
                    sys.stdout.write(line)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=timeout)
            status = {0: "ok", 1: "FAIL", 2: "ERROR"}.get(rc, f"rc={rc}")
            if rc < 0:
                status = f"killed by {signal.Signals(-rc).name}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc, status = -9, "TIMEOUT"
        reader.join(timeout=5)
    seconds = time.monotonic() - start
    row = {"step": step.name, "what": step.what, "status": status, "rc": rc,
           "seconds": round(seconds, 1), "headline": "", "failed": []}
    doc_path = out / f"{step.name}.json"
    if doc_path.exists():
        try:
            doc = json.loads(doc_path.read_text())
            row["headline"] = doc.get("headline", "")
            row["checks"] = f"{sum(c['ok'] for c in doc['checks'])}/{len(doc['checks'])}"
            row["failed"] = [c["name"] for c in doc["checks"] if not c["ok"]]
            if doc.get("error"):
                row["failed"].append(doc["error"][:200])
        except (json.JSONDecodeError, KeyError) as exc:
            row["headline"] = f"unreadable JSON: {exc}"
    if step.name == "s8_pytest":
        tail = [ln.strip("= ") for ln in log.read_text().splitlines()
                if re.search(r"\b(passed|failed|skipped|deselected|errors?)\b.* in [\d.]+s", ln)]
        row["headline"] = tail[-1] if tail else ""
        row["failed"] = [ln for ln in log.read_text().splitlines()
                         if ln.startswith(("FAILED", "ERROR"))][:20]
    print(f"=== {step.name}: {status} in {seconds:.0f} s  {row['headline']}", flush=True)
    return row


def python_with_torch() -> str:
    for cand in (sys.executable, shutil.which("python3"), shutil.which("python")):
        if cand and subprocess.run([cand, "-c", "import torch"],
                                   capture_output=True).returncode == 0:
            return cand
    return sys.executable


def step_env() -> dict[str, str]:
    """The environment of every step: the caller's, plus the source tree on PYTHONPATH (the
    caller's PYTHONPATH kept after it), offline Hugging Face, and the Triton interpreter on a
    CPU dry run only."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")) if p),
        "PYTHONUNBUFFERED": "1", "OMP_WAIT_POLICY": "PASSIVE",
        "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if ON_CPU:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    return env


def select(chosen: list[Step], wanted: str | None) -> list[Step]:
    """The steps named (or prefixed) in the comma-separated ``wanted``; all if None."""
    if not wanted:
        return chosen
    names = [s.strip() for s in wanted.split(",") if s.strip()]
    return [s for s in chosen if any(s.name == w or s.name.startswith(w) for w in names)]


def passed(rows: list[dict], chosen: list[Step]) -> bool:
    """Every step that ran is ok, and every default step ran."""
    optional = {s.name for s in chosen if s.optional}
    return all(r["status"] == "ok" or (r["step"] in optional and r["status"].startswith(
        "skipped")) for r in rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default=None,
                        help="comma-separated step names or prefixes (s3,s4_tokens); default all")
    parser.add_argument("--budget", type=float, default=float(os.environ.get(
        "VMKV_CHECK_BUDGET", DEFAULT_BUDGET_S)), help="seconds after which no new step starts")
    args = parser.parse_args()
    out = Path(os.environ.get("OUT") or ROOT / "benchmarks" / "results" /
               time.strftime("gpu-check-%Y%m%d-%H%M%S"))
    (out / "logs").mkdir(parents=True, exist_ok=True)
    py = python_with_torch()
    env = {**step_env(), "VMKV_CHECK_OUT": str(out)}
    chosen = select(steps(py, env), args.steps)
    start = time.monotonic()
    rows: list[dict] = []

    def write_summary(**extra: object) -> None:
        (out / "summary.json").write_text(json.dumps(
            {"python": py, "device": "cpu" if ON_CPU else "cuda", "budget_s": args.budget,
             "rows": rows, **extra}, indent=1))

    for step in chosen:
        left = args.budget - (time.monotonic() - start)
        row = {"step": step.name, "what": step.what, "seconds": 0, "headline": "", "failed": []}
        if step.skip:
            rows.append({**row, "status": step.skip})
        elif left < step.min_time:
            rows.append({**row, "status": "skipped (budget)"})
        else:
            rows.append(run_one(step, out, min(step.timeout, left), env))
        write_summary()
    total = time.monotonic() - start
    table = format_table(rows, total)
    (out / "summary.txt").write_text(table)
    write_summary(total_s=total)
    print("\n" + table)
    print(f"results: {out}")
    return 0 if passed(rows, chosen) else 1


def format_table(rows: list[dict], total: float) -> str:
    lines = [f"{'step':<16} {'status':<30} {'secs':>5} {'checks':>7}  headline"]
    for r in rows:
        lines.append(f"{r['step']:<16} {r['status']:<30} {r['seconds']:>5.0f} "
                     f"{r.get('checks', ''):>7}  {r['headline']}"[:220])
        for name in r.get("failed", [])[:12]:
            lines.append(f"{'':<16} - {name}"[:220])
    lines.append(f"total {total:.0f} s")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
