"""The GPU check: every step in its own process with its own timeout, one summary at the end.

    bash benchmarks/gpu/check.sh                       # all steps, ~7 minutes on the H200
    bash benchmarks/gpu/check.sh --steps s3,s4         # rerun some steps
    bash benchmarks/gpu/check.sh --budget 300          # stop starting steps after 300 s

Results go to ``$OUT`` if set (the device tool brings that folder back), else
``benchmarks/results/gpu-check-<time>/``: one JSON per step, ``logs/<step>.log``,
``summary.json`` and ``summary.txt``. A step that dies (error 700 kills the CUDA context,
SIGSEGV, timeout) is reported as such and the next step starts in a fresh process. Nothing is
installed; the source tree runs from ``PYTHONPATH=.``.
"""

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
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@dataclass
class Step:
    name: str
    cmd: list[str]
    timeout: float
    what: str
    env: dict[str, str] = field(default_factory=dict)
    min_time: float = 15.0  # do not start with less than this left


def steps(py: str) -> list[Step]:
    script = lambda name: [py, str(HERE / f"{name}.py")]  # noqa: E731
    pytest_cmd = [py, "-m", "pytest", "-m", "gpu", "-q", "--tb=short", "-p", "no:cacheprovider",
                  "--continue-on-collection-errors", "-rfEs", str(ROOT / "tests")]
    try:
        import pytest_timeout  # noqa: F401

        pytest_cmd += ["--timeout", "120"]
    except ImportError:
        pass
    sanitizer = shutil.which("compute-sanitizer")
    out = [
        Step("s0_env", script("s0_env"), 40, "versions, driver, granularity, bandwidth"),
        Step("s1_vmm_smoke", script("s1_vmm_smoke"), 40, "VMM + torch + cupy round trip"),
        Step("s2_vmm_latency", script("s2_vmm_latency"), 45, "per-page VMM latency, mapper"),
        Step("s3_attention", script("s3_attention"), 90, "kernels vs fp32 ref, tails unmapped"),
        Step("s4_tokens", script("s4_tokens"), 90, "greedy tokens vs transformers, engine"),
        Step("s5_bench_cli", script("s5_bench_cli"), 110, "vmkv bench throughput / kernels",
             env={"VMKV_STEP_BUDGET": "90"}, min_time=40),
        Step("s6_decode", script("s6_decode"), 100, "8B decode step vs roofline",
             env={"VMKV_STEP_BUDGET": "75"}, min_time=40),
        Step("s7_twins", script("s7_twins"), 70, "Triton + CUDA twins, 8B shapes",
             env={"VMKV_STEP_BUDGET": "35"}),
        Step("s8_pytest", pytest_cmd, 120, "pytest -m gpu"),
    ]
    if sanitizer:
        out.append(Step("s9_sanitize", [sanitizer, "--tool", "memcheck", "--error-exitcode",
                                        "9", "--print-limit", "20", *script("s9_sanitize")],
                        90, "memcheck: no access to unmapped VA", min_time=45))
    return out


def run_one(step: Step, out: Path, timeout: float, env: dict[str, str]) -> dict:
    log = out / "logs" / f"{step.name}.log"
    start = time.monotonic()
    print(f"\n=== {step.name}: {step.what} (timeout {timeout:.0f} s)", flush=True)
    with log.open("w") as f:
        proc = subprocess.Popen(step.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                cwd=ROOT, env={**env, **step.env}, start_new_session=True,
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default=None,
                        help="comma-separated step names or prefixes (s3,s4_tokens); default all")
    parser.add_argument("--budget", type=float, default=float(os.environ.get(
        "VMKV_CHECK_BUDGET", "450")), help="seconds after which no new step starts")
    args = parser.parse_args()
    out = Path(os.environ.get("OUT") or ROOT / "benchmarks" / "results" /
               time.strftime("gpu-check-%Y%m%d-%H%M%S"))
    (out / "logs").mkdir(parents=True, exist_ok=True)
    py = python_with_torch()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")) if p),
        "PYTHONUNBUFFERED": "1", "OMP_WAIT_POLICY": "PASSIVE", "VMKV_CHECK_OUT": str(out),
        "TOKENIZERS_PARALLELISM": "false"}
    env.pop("TRITON_INTERPRET", None)
    chosen = steps(py)
    if args.steps:
        want = [s.strip() for s in args.steps.split(",") if s.strip()]
        chosen = [s for s in chosen if any(s.name == w or s.name.startswith(w) for w in want)]
    start = time.monotonic()
    rows = []
    for step in chosen:
        left = args.budget - (time.monotonic() - start)
        if left < step.min_time:
            rows.append({"step": step.name, "what": step.what, "status": "skipped (budget)",
                         "seconds": 0, "headline": "", "failed": []})
            continue
        rows.append(run_one(step, out, min(step.timeout, left), env))
        (out / "summary.json").write_text(json.dumps({"python": py, "rows": rows}, indent=1))
    table = format_table(rows, time.monotonic() - start)
    (out / "summary.txt").write_text(table)
    (out / "summary.json").write_text(json.dumps({"python": py, "rows": rows,
                                                  "total_s": time.monotonic() - start},
                                                 indent=1))
    print("\n" + table)
    print(f"results: {out}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


def format_table(rows: list[dict], total: float) -> str:
    lines = [f"{'step':<16} {'status':<22} {'secs':>5} {'checks':>7}  headline"]
    for r in rows:
        lines.append(f"{r['step']:<16} {r['status']:<22} {r['seconds']:>5.0f} "
                     f"{r.get('checks', ''):>7}  {r['headline']}"[:220])
        for name in r.get("failed", [])[:12]:
            lines.append(f"{'':<16} - {name}"[:220])
    lines.append(f"total {total:.0f} s")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
