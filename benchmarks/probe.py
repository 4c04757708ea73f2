"""What the operating system sees of a running ``vmkv serve`` process, for the reliability
benchmarks (soak.py, elastic_memory.py, abuse.py): the sampling lives in
:mod:`vmkv.bench.os_memory` (also used by ``vmkv bench study``); this module adds saving."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from vmkv.bench.os_memory import Sampler, memfd_bytes, meminfo, sample, scrape

__all__ = ["Sampler", "memfd_bytes", "meminfo", "sample", "save", "scrape"]


def save(result: dict[str, Any], json_path: str | None, plot_path: str | None,
         plot: Callable[[dict[str, Any], str], None]) -> None:
    """Write the result as JSON and draw it, where asked to."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    if plot_path:
        plot(result, plot_path)
