"""The GPU check's CPU dry run, exactly as docs/gpu.md gives it
(``VMKV_CHECK_DEVICE=cpu bash benchmarks/gpu/check.sh``), where pytest, fastapi, uvicorn,
pydantic and gguf cannot be imported (the GPU image lacks them): stub packages that raise
ImportError come first on PYTHONPATH, which check.py hands to every step. Every default step
and s5 must pass; s8 must see that pytest is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = ("pytest", "fastapi", "uvicorn", "pydantic", "gguf")
MUST_PASS = ("s0_env", "s1_vmm_smoke", "s2_vmm_latency", "s3_attention", "s4_tokens",
             "s6_decode", "s7_twins", "s5_bench_cli", "s10_tensor_parallel",
             "s11_sliding_window", "s12_spec_decode", "s13_fp8_kv")


def blocking_stubs(folder: Path) -> Path:
    """Packages named like the blocked ones whose import raises ImportError."""
    for name in BLOCKED:
        (folder / name).mkdir(parents=True)
        (folder / name / "__init__.py").write_text(
            f"raise ImportError('{name} is made unimportable: the GPU image lacks it')\n")
    return folder


@pytest.mark.slow
def test_cpu_dry_run_of_the_gpu_check_without_test_or_server_packages(tmp_path: Path) -> None:
    stubs = blocking_stubs(tmp_path / "stubs")
    out = tmp_path / "out"
    env = {**os.environ, "VMKV_CHECK_DEVICE": "cpu", "OUT": str(out), "PYTHON": sys.executable,
           "PYTHONPATH": str(stubs), "VMKV_CHECK_WORK": str(tmp_path / "work")}
    blocked = subprocess.run([sys.executable, "-c", "import pytest"], env=env,
                             capture_output=True, text=True)
    assert blocked.returncode != 0 and "made unimportable" in blocked.stderr
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu" / "check.sh")], env=env,
                          capture_output=True, text=True, timeout=600)
    summary = json.loads((out / "summary.json").read_text())
    status = {row["step"]: row["status"] for row in summary["rows"]}
    assert all(status.get(step) == "ok" for step in MUST_PASS), (status, proc.stdout[-6000:])
    assert status["s8_pytest"] == "skipped: no pytest"
    assert status["s9_sanitize"].startswith("skipped")
    assert proc.returncode == 0, proc.stdout[-3000:]
    toolchain = json.loads((out / "s0_env.json").read_text())["data"]["toolchain"]
    assert toolchain["pytest"].startswith("absent (ImportError")  # the steps saw the stubs
    assert (out / "summary.txt").is_file() and (out / "logs" / "s3_attention.log").is_file()
