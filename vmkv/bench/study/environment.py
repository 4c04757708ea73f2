"""The machine a study ran on: CPU (model, flags, cores), memory, kernel, transparent huge pages
and shared-memory settings, what the performance counters allow, versions and the commit."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from vmkv.bench.report import environment as bench_environment
from vmkv.cpu_info import bf16_hardware, cpu_features, cpu_model

THP = Path("/sys/kernel/mm/transparent_hugepage")


def _read(path: str | Path) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _selected(text: str | None) -> str | None:
    """The bracketed choice of a sysfs setting (``always [madvise] never`` -> ``madvise``)."""
    if text is None or "[" not in text:
        return text
    return text.split("[", 1)[1].split("]", 1)[0]


def transparent_hugepages() -> dict[str, str | None]:
    """THP for anonymous memory and for shmem/memfd (where the KV pool lives), as set."""
    return {name: _selected(_read(THP / name))
            for name in ("enabled", "defrag", "shmem_enabled", "khugepaged/defrag")}


def memory_total() -> int | None:
    """MemTotal of /proc/meminfo in bytes."""
    for line in (_read("/proc/meminfo") or "").splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return None


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def versions() -> dict[str, str | None]:
    import numpy
    import torch

    import vmkv

    found: dict[str, str | None] = {"vmkv": vmkv.__version__, "torch": torch.__version__,
                                    "numpy": numpy.__version__}
    for name in ("transformers", "matplotlib", "triton"):
        try:
            found[name] = __import__(name).__version__
        except ImportError:
            found[name] = None
    return found


def machine() -> str:
    """This CPU in one line: its model, cores and bfloat16 hardware (what a part ran on)."""
    bf16 = ", ".join(bf16_hardware()) or "no bfloat16 hardware"
    return f"{cpu_model() or platform.uname().machine}, {os.cpu_count()} cores ({bf16})"


def describe(tlb: dict[str, Any]) -> dict[str, Any]:
    """Everything :mod:`vmkv.bench.report` records, plus the machine's details; ``tlb`` says
    whether TLB-miss counters are readable here (:func:`~.counters.tlb_readable`)."""
    commit = _git("rev-parse", "HEAD")
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    uname = platform.uname()
    return {
        **bench_environment(),
        "cpu_model": cpu_model() or uname.processor or uname.machine,
        "cpu_flags": cpu_features().split(),
        "bf16_hardware": list(bf16_hardware()),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "memory_bytes": memory_total(),
        "kernel": f"{uname.system} {uname.release}",
        "kernel_version": uname.version,
        "transparent_hugepage": transparent_hugepages(),
        "vm_max_map_count": _read("/proc/sys/vm/max_map_count"),
        "perf_event_paranoid": _read("/proc/sys/kernel/perf_event_paranoid"),
        "tlb_counters": tlb,
        "load_average": list(os.getloadavg()),
        "versions": versions(),
        "commit_full": commit,
        "uncommitted_changes": bool(dirty) if dirty is not None else None,
    }
