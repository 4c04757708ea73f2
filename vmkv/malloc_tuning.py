"""glibc malloc tuning for the engine process (what vLLM gets by preloading tcmalloc).

With glibc's defaults a block of 128 KiB or more (dynamically raised up to 32 MiB) is its own
``mmap`` and goes back to the OS on free, so every step's activations (a [64, 1536] float32
MLP input is 384 KiB; logits of 64 rows 12 MiB) are page-faulted in afresh: 2.7 million faults
in a 39 s run of 32 requests on the default model. Serving blocks below 32 MiB from the heap and
keeping up to 256 MiB of freed heap cut that to 0.55 million and raised output tokens/s by 1 to
5.5 % (docs/benchmarks.md). The cost is up to ``TRIM_THRESHOLD`` bytes of freed memory kept in RSS.

``VMKV_MALLOC_TUNING=0`` leaves malloc alone. Other C libraries (no ``mallopt``) are left alone.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's maximum (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = 256 << 20
TOP_PAD = 64 << 20


def tune_malloc() -> bool:
    """Apply the settings above through ``mallopt``; True if they took effect.

    Skipped (False) when ``VMKV_MALLOC_TUNING=0`` or the C library has no ``mallopt``.
    """
    if os.environ.get("VMKV_MALLOC_TUNING", "1") == "0":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own symbols: its C library's
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        (M_TOP_PAD, TOP_PAD)))
