"""What the machine offers beyond Python packages (step 0): pytest, a C compiler and
``Python.h`` (Triton builds its launchers with them), nvcc, ninja, compute-sanitizer, ncu.

Every probe returns a fact (a version, a path, ``"absent: ..."``); none raises.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path
from typing import Any


def command_output(args: list[str], timeout: float = 15) -> str:
    """stdout + stderr of ``args``, or ``"unavailable: ..."`` when it cannot run."""
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
        return (proc.stdout + proc.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unavailable: {exc}"


def tool(name: str, version_args: tuple[str, ...] = ("--version",)) -> dict[str, Any]:
    """Path of ``name`` on PATH and its version output (no licence lines, 6 lines at most);
    path None if absent."""
    path = shutil.which(name)
    if path is None:
        return {"path": None}
    lines = [ln for ln in command_output([path, *version_args]).splitlines()
             if not any(w in ln.lower() for w in ("copyright", "free software", "warranty"))]
    return {"path": path, "version": lines[:6]}


def module_version(name: str) -> str:
    """``name``'s version if it imports, else ``"absent (<exception>)"``."""
    try:
        mod = __import__(name, fromlist=["_"])
    except Exception as exc:  # noqa: BLE001 - stubs raise ImportError, broken installs worse
        return f"absent ({type(exc).__name__}: {str(exc)[:120]})"
    return str(getattr(mod, "__version__", "present"))


def python_header() -> dict[str, Any]:
    """Where ``Python.h`` should be (sysconfig's include path) and whether it is there."""
    include = sysconfig.get_paths()["include"]
    return {"include": include, "exists": (Path(include) / "Python.h").is_file()}


def toolchain_facts() -> dict[str, Any]:
    """Every toolchain fact step 0 records."""
    return {
        "pytest": module_version("pytest"),
        "CC": os.environ.get("CC"),
        "cc": tool("cc"), "gcc": tool("gcc"), "clang": tool("clang"),
        "python_h": python_header(),
        "nvcc": tool("nvcc"), "ninja": tool("ninja"),
        "compute_sanitizer": tool("compute-sanitizer"), "ncu": tool("ncu"),
    }
