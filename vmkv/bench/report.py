"""Shared output of the benchmarks: environment facts, tables on stdout, JSON files."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from vmkv import envs
from vmkv.cpu_info import bf16_hardware, cpu_features, cpu_model


def environment() -> dict[str, Any]:
    """Versions, machine and commit, recorded with every result."""
    import torch

    env: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_features(),
        "bf16_hardware": list(bf16_hardware()),
        "cpu_count": os.cpu_count(),
        "omp_wait_policy": envs.omp_wait_policy(),
        "torch_threads": torch.get_num_threads(),
        "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "commit": _git_commit(),
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    return env


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5, cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A plain fixed-width table of ``rows`` (dicts) restricted to ``columns``."""
    cells = [[_fmt(row.get(c, "")) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def write_json(path: str | os.PathLike[str] | None, payload: dict[str, Any]) -> None:
    """Write ``payload`` plus the environment to ``path`` (no-op when path is None)."""
    if path is None:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"environment": environment(), **payload}, f, indent=2, default=str)
