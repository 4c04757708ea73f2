"""Timing helpers shared by every benchmark (``vmkv bench ...`` and ``benchmarks/gpu``).

On CUDA a sample is timed with CUDA events around ``inner`` back-to-back calls (what the device
spent, not the host's launch time); on the CPU with ``perf_counter_ns``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def sync(device: str | torch.device) -> None:
    """Wait for queued work on ``device`` (nothing to wait for on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def call_ms(fn: Callable[[], Any], device: str | torch.device = "cpu", inner: int = 1) -> float:
    """Milliseconds per call of ``fn``, one sample of ``inner`` back-to-back calls."""
    if torch.device(device).type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / inner
    t = time.perf_counter_ns()
    for _ in range(inner):
        fn()
    return (time.perf_counter_ns() - t) / 1e6 / inner


def time_ms(fn: Callable[[], Any], device: str | torch.device = "cpu", *, warmup: int = 3,
            iters: int = 10, inner: int = 1) -> dict[str, float]:
    """Median and min of ``iters`` samples (:func:`call_ms`) after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    samples = [call_ms(fn, device, inner) for _ in range(iters)]
    return {"median_ms": statistics.median(samples), "min_ms": min(samples)}
