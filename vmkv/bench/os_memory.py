"""What the operating system sees of a running ``vmkv serve`` process, sampled from outside it
(the elastic-memory part of ``vmkv bench study``; benchmarks/soak.py, elastic_memory.py).

- ``memfd``: bytes the KV pool's memfd really holds (``st_blocks`` through /proc/PID/fd): pages
  that are unmapped but still allocated count here, and not in RSS;
- ``rss`` / ``rss_shmem``: the process's resident set and its shared-memory part (``VmRSS``,
  ``RssShmem`` of /proc/PID/status: the memfd pages it has mapped and touched);
- ``shmem`` / ``mem_available``: /proc/meminfo, system-wide (other processes move them too);
- the server's own /metrics gauges (KV bytes in use, held, allocated, cached; queue lengths).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Any

POOL_FD_NAME = "memfd:vmkv-kv-pool"
METRICS = {
    "in_use": "vmkv:kv_physical_bytes_in_use",
    "held": "vmkv:kv_physical_bytes_held",
    "allocated": "vmkv:kv_pool_allocated_bytes",
    "cached": "vmkv:kv_prefix_cached_bytes",
    "token_bytes": "vmkv:kv_token_bytes",
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "preemptions": "vllm:num_preemptions_total",
}


def memfd_bytes(pid: int) -> int:
    """Bytes allocated in the process's KV pool memfd(s), as the kernel counts them."""
    total = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if POOL_FD_NAME in os.readlink(fd):
                total += os.stat(fd).st_blocks * 512
        except OSError:  # closed meanwhile
            continue
    return total


def _kib_fields(path: str, names: tuple[str, ...]) -> dict[str, int]:
    """``name: N kB`` lines of a /proc file, in bytes (missing names are left out)."""
    values = {}
    for line in Path(path).read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in names:
            values[name] = int(rest.split()[0]) * 1024
    return values


def process_memory(pid: int) -> dict[str, int]:
    """Resident set and its shared-memory part of process ``pid``, in bytes."""
    values = _kib_fields(f"/proc/{pid}/status", ("VmRSS", "RssShmem"))
    return {"rss": values.get("VmRSS", 0), "rss_shmem": values.get("RssShmem", 0)}


def meminfo() -> dict[str, int]:
    """``Shmem`` and ``MemAvailable`` of /proc/meminfo, in bytes."""
    values = _kib_fields("/proc/meminfo", ("Shmem", "MemAvailable"))
    return {"shmem": values["Shmem"], "mem_available": values["MemAvailable"]}


def scrape(client: Any, url: str) -> dict[str, float]:
    """The /metrics gauges of :data:`METRICS`, plus rejected requests by reason."""
    from prometheus_client.parser import text_string_to_metric_families

    text = client.get(f"{url}/metrics", timeout=30).text
    found: dict[str, float] = {}
    names = {v: k for k, v in METRICS.items()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                found[names[sample.name]] = sample.value
            elif sample.name == "vmkv:requests_rejected_total":
                found[f"rejected_{sample.labels['reason']}"] = sample.value
    return found


def sample(pid: int, client: Any, url: str, started: float) -> dict[str, Any]:
    """One row of the time series."""
    import httpx

    row: dict[str, Any] = {"t": round(time.monotonic() - started, 2), **process_memory(pid),
                           "memfd": memfd_bytes(pid), **meminfo()}
    with contextlib.suppress(httpx.HTTPError):  # draining or gone: the OS numbers still count
        row.update(scrape(client, url))
    return row


class Sampler(threading.Thread):
    """Samples a server every ``interval`` seconds until :meth:`stop`; rows in ``rows``."""

    def __init__(self, pid: int, url: str, interval: float, started: float) -> None:
        super().__init__(daemon=True)
        self.pid, self.url, self.interval, self.started = pid, url, interval, started
        self.rows: list[dict[str, Any]] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        import httpx

        with httpx.Client() as client:
            while not self._stop_event.is_set():
                self.rows.append(sample(self.pid, client, self.url, self.started))
                self._stop_event.wait(self.interval)

    def stop(self) -> list[dict[str, Any]]:
        self._stop_event.set()
        self.join()
        return self.rows
