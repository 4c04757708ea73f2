"""What this CPU is and can do, read from ``/proc/cpuinfo`` (no torch: the config reads it).

    cpu_features()        the instruction-set flags (kernel build keys, bench reports)
    cpu_vendor()          GenuineIntel, AuthenticAMD, ...
    bf16_hardware()       the flags that mean native bfloat16 arithmetic, if any
"""

from __future__ import annotations

import functools
import platform

#: flags (``/proc/cpuinfo``) that mean bfloat16 hardware: AMX tiles, AVX-512 dot products
BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def _cpuinfo(*fields: str) -> str | None:
    """The first of ``fields`` in ``/proc/cpuinfo`` (None where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(fields):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


@functools.cache
def cpu_features() -> str:
    """This CPU's instruction-set flags (``/proc/cpuinfo``; the machine name elsewhere)."""
    return _cpuinfo("flags", "Features") or platform.machine() + platform.processor()


@functools.cache
def cpu_vendor() -> str:
    """This CPU's ``vendor_id`` (e.g. ``GenuineIntel``, ``AuthenticAMD``; "" if unknown)."""
    return _cpuinfo("vendor_id") or ""


def cpu_model() -> str:
    """This CPU's model name ("" if unknown)."""
    return _cpuinfo("model name") or ""


def bf16_hardware() -> tuple[str, ...]:
    """The flags of :data:`BF16_FLAGS` this CPU has (empty: no bfloat16 hardware)."""
    flags = set(cpu_features().split())
    return tuple(f for f in BF16_FLAGS if f in flags)
