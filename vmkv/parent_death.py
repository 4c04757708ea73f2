"""A child process that must not outlive its parent (data-parallel replicas, tensor-parallel
workers): the kernel kills it when the parent goes."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

logger = logging.getLogger("vmkv")

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent goes (Linux: when the parent's
    *thread* that started it ends; elsewhere the parent's close or a closed pipe ends it);
    exit now if the parent is already gone."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            logger.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    if os.getppid() != parent_pid:  # it died before the prctl took effect
        os._exit(1)
