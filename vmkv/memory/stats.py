"""Counters and latency samples of a memory backend (map, unmap, create, release)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

_SAMPLES = 4096  # latency samples kept per operation (a ring: the most recent ones)


@dataclass
class OpStats:
    """Call count, pages touched, total time and recent per-call latencies of one operation."""

    calls: int = 0
    pages: int = 0
    total_ns: int = 0
    recent_ns: deque[int] = field(default_factory=lambda: deque(maxlen=_SAMPLES))

    def record(self, num_pages: int, elapsed_ns: int) -> None:
        self.calls += 1
        self.pages += num_pages
        self.total_ns += elapsed_ns
        self.recent_ns.append(elapsed_ns)

    def percentile_us(self, q: float) -> float:
        """Percentile ``q`` (0-100) of recent per-call latency in microseconds (0 if none)."""
        if not self.recent_ns:
            return 0.0
        return float(np.percentile(np.fromiter(self.recent_ns, dtype=np.int64), q)) / 1e3

    def as_dict(self) -> dict[str, float]:
        return {
            "calls": self.calls,
            "pages": self.pages,
            "total_ms": self.total_ns / 1e6,
            "p50_us": self.percentile_us(50),
            "p99_us": self.percentile_us(99),
        }


class MemoryStats:
    """Per-operation statistics; ``with stats.timed("map", n): ...`` records one call."""

    OPS = ("map", "unmap", "create", "touch", "populate", "release")

    def __init__(self) -> None:
        self.ops: dict[str, OpStats] = {op: OpStats() for op in self.OPS}

    @contextmanager
    def timed(self, op: str, num_pages: int) -> Iterator[None]:
        start = time.perf_counter_ns()
        yield  # a failing call raises through here and is not recorded
        self.ops[op].record(num_pages, time.perf_counter_ns() - start)

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {op: s.as_dict() for op, s in self.ops.items()}
