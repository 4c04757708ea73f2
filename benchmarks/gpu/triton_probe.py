"""A one-element Triton kernel: the smallest real launch (steps 0 and 1).

Triton compiles a kernel's launcher with the host C compiler and ``Python.h`` on first use, and
the launcher asks the driver about every pointer argument (``extractPointer`` in
``third_party/nvidia/backend/driver.c``), so one launch proves the toolchain and shows how a
pointer is judged. Under ``TRITON_INTERPRET=1`` (the CPU dry run) the kernel is interpreted.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl


@triton.jit
def _store_one(ptr, index, value):
    tl.store(ptr + index, value)


def store_one(t: torch.Tensor, index: int, value: float) -> None:
    """Write ``value`` at element ``index`` of ``t`` with one Triton program."""
    _store_one[(1,)](t, index, value)


def mode() -> str:
    """How Triton runs kernels in this process."""
    return "interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "compiled"


def outcome(fn: Callable[[], Any]) -> str:
    """``"ok"`` if ``fn()`` returns, else the exception's type and message (not raised)."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the outcome is the fact recorded
        return f"{type(exc).__name__}: {exc}"
    return "ok"
