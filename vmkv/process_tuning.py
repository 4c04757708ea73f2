"""Process-wide tuning of an engine process: OpenMP waiting and glibc malloc.

``import vmkv`` changes nothing in the process. The entry points that own their process call
:func:`tune_process` explicitly: the ``vmkv`` CLI first thing in ``main``, ``LLM(...)`` before
it loads torch, and the server's ``serve``. ``VMKV_PROCESS_TUNING=0`` turns it all off.

OpenMP: ``OMP_WAIT_POLICY=PASSIVE`` and ``GOMP_SPINCOUNT=20000`` (each only when unset) are read
once, when torch loads its OpenMP runtime, so they take effect only if set before the first
``import torch``. A program that imports torch before building an ``LLM`` must set them in the
environment itself (or call :func:`tune_process` before importing torch). Measured on a 2-core
machine: a [64, 576] multiply takes 49 µs with PASSIVE alone and 6 µs with both, and a SmolLM2
decode step of 64 requests 187 ms vs 159 ms (docs/benchmarks.md).

malloc: with glibc's defaults a block of 128 KiB or more (dynamically raised up to 32 MiB) is
its own ``mmap`` and goes back to the OS on free, so every step's activations (a [64, 1536]
float32 MLP input is 384 KiB; logits of 64 rows 12 MiB) are page-faulted in afresh: 2.7 million
faults in a 39 s run of 32 requests on the default model. Serving blocks below 32 MiB from the
heap and keeping up to 256 MiB of freed heap cut that to 0.55 million and raised output
tokens/s by 1 to 5.5 % (docs/benchmarks.md). The cost is up to ``TRIM_THRESHOLD`` bytes of freed
memory kept in RSS. C libraries without ``mallopt`` are left alone.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
from typing import NamedTuple

from vmkv import envs

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's maximum (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = 256 << 20
TOP_PAD = 64 << 20


class Tuning(NamedTuple):
    """What :func:`tune_process` found in effect afterwards."""

    openmp: bool  # the OpenMP variables are set, and were before torch loaded
    malloc: bool  # mallopt accepted every setting


def tune_process() -> Tuning:
    """Apply both tunings unless ``VMKV_PROCESS_TUNING=0``; safe to call more than once."""
    if not envs.process_tuning():
        return Tuning(openmp=False, malloc=False)
    return Tuning(openmp=tune_openmp(), malloc=tune_malloc())


def tune_openmp() -> bool:
    """Put the OpenMP defaults in the environment if torch has not loaded yet.

    True when every tuned variable is set (by us now, or already by the user). Once torch is
    loaded the environment is left alone: changing it would no longer reach OpenMP.
    """
    tuned = {var: var.tuned for var in envs.ALL if var.tuned is not None}
    if "torch" not in sys.modules:
        for var, value in tuned.items():
            os.environ.setdefault(var.name, value)
    missing = [var.name for var in tuned if var.get() is None]
    if missing:
        _log_late_openmp(tuple(missing))
    return not missing


@functools.cache
def _log_late_openmp(missing: tuple[str, ...]) -> None:  # cached: said once per process
    logger.info("torch was imported before vmkv could set %s; set them in the environment "
                "for faster CPU steps (docs/configuration.md)", ", ".join(missing))


def tune_malloc() -> bool:
    """Apply the malloc settings above through ``mallopt``; True if they took effect."""
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own symbols: its C library's
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        (M_TOP_PAD, TOP_PAD)))


def available_cores() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def replica_threads(num_replicas: int) -> int:
    """Compute threads for each of ``num_replicas`` engine processes sharing this machine:
    ``cores // num_replicas``, at least 1 (the replicas must not oversubscribe the cores)."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be positive, got {num_replicas}")
    return max(1, available_cores() // num_replicas)
