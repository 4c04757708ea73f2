"""Failpoints of a memory backend: make its next OS/driver calls fail, on purpose.

Every backend owns a :class:`FaultInjector` (``backend.faults``), disarmed by default. Arming it
makes chosen operations raise exactly what the real call raises when the OS or driver refuses:

    op        host (Linux)                         CUDA
    create    fallocate(memfd)                     cuMemCreate
    map       mmap(MAP_FIXED | MAP_SHARED, memfd)  cuMemMap
    release   fallocate(PUNCH_HOLE)                cuMemRelease

    error     raised as
    ENOMEM    VmmError("... failed: Cannot allocate memory (ENOMEM)")  / CUDA_ERROR_OUT_OF_MEMORY
    EPERM     VmmError("... failed: Operation not permitted (EPERM)")  / CUDA_ERROR_NOT_PERMITTED
    BUDGET    MappingBudgetExceeded (``map`` only: the VMA budget is exhausted)

so the layers above (page pool, regions, KV managers, scheduler) are tested against the failures
they must survive without a machine that is really out of memory::

    kv.backend.faults.arm("map", "ENOMEM", after=3)   # the 4th map call fails, once
    kv.backend.faults.arm("create", "EPERM", times=2)  # the next two creates fail

Arming is the test's (or an operator's) explicit choice; nothing arms it implicitly. It is not
thread-safe: arm it on the thread that uses the backend (the engine thread; ``AsyncEngine.call``).
"""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass

from vmkv.memory.errors import MappingBudgetExceeded, VmmError

logger = logging.getLogger("vmkv")

OPS = ("create", "map", "release")
ERRORS = ("ENOMEM", "EPERM", "BUDGET")
#: the CUresult a CUDA driver returns for each errno-style error
CUDA_ERRORS = {"ENOMEM": "CUDA_ERROR_OUT_OF_MEMORY", "EPERM": "CUDA_ERROR_NOT_PERMITTED"}


@dataclass
class _Armed:
    error: str
    after: int  # calls to let through first
    times: int  # failures left


class FaultInjector:
    """Which operations fail next, and how; ``fired`` counts the failures raised per op."""

    def __init__(self) -> None:
        self._armed: dict[str, _Armed] = {}
        self.fired: dict[str, int] = dict.fromkeys(OPS, 0)

    def arm(self, op: str, error: str = "ENOMEM", *, after: int = 0, times: int = 1) -> None:
        """Let ``after`` calls of ``op`` succeed, then fail the next ``times`` with ``error``."""
        if op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {op!r}")
        if error not in ERRORS:
            raise ValueError(f"error must be one of {ERRORS}, got {error!r}")
        if error == "BUDGET" and op != "map":
            raise ValueError("BUDGET (the VMA budget) can only fail a map")
        if after < 0 or times < 1:
            raise ValueError(f"need after >= 0 and times >= 1, got after={after}, times={times}")
        self._armed[op] = _Armed(error, after, times)

    def disarm(self) -> None:
        """Fail nothing any more."""
        self._armed.clear()

    @property
    def armed(self) -> bool:
        return bool(self._armed)

    def check(self, op: str, call: str, *, cuda: bool = False) -> None:
        """Raise the armed error if this call of ``op`` is to fail (``call``: what the backend
        calls, for the message); a no-op when disarmed."""
        armed = self._armed.get(op)
        if armed is None:
            return
        if armed.after:
            armed.after -= 1
            return
        armed.times -= 1
        if not armed.times:
            del self._armed[op]
        self.fired[op] += 1
        logger.warning("failpoint: %s (%s) fails with %s", op, call, armed.error)
        raise failure(armed.error, call, cuda=cuda)


def failure(error: str, call: str, *, cuda: bool = False) -> VmmError:
    """The exception the real ``call`` raises for ``error`` on the host or CUDA backend."""
    if error == "BUDGET":
        return MappingBudgetExceeded(f"{call}: the VMA budget is exhausted")
    if cuda:
        return VmmError(f"{call} failed: {CUDA_ERRORS[error]}")
    return os_failure(call, getattr(errno, error))


def os_failure(call: str, err: int) -> VmmError:
    """``VmmError`` for a failed libc call: ``"<call> failed: <strerror> (<ERRNO>)"``."""
    return VmmError(f"{call} failed: {os.strerror(err)} ({errno.errorcode.get(err, err)})")
