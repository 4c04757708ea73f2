"""Process counters around a measured run: page faults and context switches (``getrusage``,
every thread of this process) and TLB misses (``perf stat -p`` on this process, where the CPU
and the kernel let it read them: virtual machines often do not, and that is recorded as data).
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

TLB_EVENTS = ("dTLB-load-misses", "dTLB-store-misses", "iTLB-load-misses")


def _parse_perf_csv(text: str) -> dict[str, int | str]:
    """``perf stat -x,`` lines -> {event: count, or why not: "not supported"/"not counted"}."""
    found: dict[str, int | str] = {}
    for line in text.splitlines():
        fields = line.split(",")
        if len(fields) < 3 or fields[2] not in TLB_EVENTS:
            continue
        value = fields[0]
        found[fields[2]] = int(value) if value.isdigit() else value.strip("<>")
    return found


@functools.cache
def tlb_readable() -> dict[str, Any]:
    """Whether ``perf stat`` reads TLB misses here: ``{"readable": bool, "reason": str,
    "events": {...}}`` from one ``perf stat -e ... -- true``."""
    perf = shutil.which("perf")
    if perf is None:
        return {"readable": False, "reason": "perf is not installed", "events": {}}
    try:
        out = subprocess.run([perf, "stat", "-x", ",", "-e", ",".join(TLB_EVENTS), "--", "true"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"readable": False, "reason": f"perf stat failed: {exc}", "events": {}}
    events = _parse_perf_csv(out.stderr)
    readable = [e for e, v in events.items() if isinstance(v, int)]
    if out.returncode != 0 or not readable:
        why = ", ".join(f"{e} {v}" for e, v in events.items()) or out.stderr.strip()[-200:]
        return {"readable": False, "reason": f"perf stat: {why}", "events": events}
    return {"readable": True, "reason": f"perf stat reads {', '.join(readable)}",
            "events": events}


class PerfStat:
    """``perf stat -p <this process>`` for the TLB events, from :meth:`start` to :meth:`stop`."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            ["perf", "stat", "-x", ",", "-e", ",".join(TLB_EVENTS), "-p", str(os.getpid())],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(0.2)  # attached before the run starts

    def stop(self) -> dict[str, int | str]:
        self.proc.send_signal(signal.SIGINT)
        _, err = self.proc.communicate(timeout=30)
        return _parse_perf_csv(err)


@contextmanager
def process_counters() -> Iterator[dict[str, Any]]:
    """Yields a dict filled on exit with this process's minor and major page faults, voluntary
    and involuntary context switches over the block, and ``tlb`` (per event counts, or None
    where the counters are not readable: see :func:`tlb_readable`)."""
    out: dict[str, Any] = {}
    perf = PerfStat() if tlb_readable()["readable"] else None
    before = resource.getrusage(resource.RUSAGE_SELF)
    try:
        yield out
    finally:
        after = resource.getrusage(resource.RUSAGE_SELF)
        out.update(minor_faults=after.ru_minflt - before.ru_minflt,
                   major_faults=after.ru_majflt - before.ru_majflt,
                   voluntary_switches=after.ru_nvcsw - before.ru_nvcsw,
                   involuntary_switches=after.ru_nivcsw - before.ru_nivcsw,
                   tlb=perf.stop() if perf is not None else None)
