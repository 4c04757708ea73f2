"""Compile a C/C++/CUDA source into a cached shared library and open it with ctypes.

Builds are keyed by the hash of the source and its local headers, and the flags (and, for
``-march=native``, the CPU's instruction sets: a cache directory shared between machines must
not hand an AVX-512 build to a CPU without AVX-512), cached under ``$VMKV_BUILD_DIR`` (default
``~/.cache/vmkv/csrc``) and published with an atomic rename, so concurrent builders never load a
partial file. The libraries have a plain C ABI and link no torch: no torch headers to compile,
no dependence on torch's C++ ABI.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from vmkv import envs
from vmkv.cpu_info import cpu_features

CSRC = Path(__file__).resolve().parents[2] / "csrc"
#: how the CPU kernels (csrc/cpu_*.cpp) are built
CPU_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")

logger = logging.getLogger(__name__)


def build_shared_library(source: Path, compiler: str, flags: Sequence[str], name: str,
                         out_dir: str | Path | None = None, verbose: bool = False) -> Path:
    """Path of ``source`` built with ``compiler flags``; builds it if no cached copy exists.

    Raises RuntimeError with the compiler's output when the build fails.
    """
    if not source.is_file():
        raise RuntimeError(f"kernel source {source} is missing (vmkv needs its source tree)")
    key = " ".join(flags) + (cpu_features() if "-march=native" in flags else "")
    digest = hashlib.sha256(_source_bytes(source) + key.encode()).hexdigest()[:16]
    out = Path(out_dir).expanduser() if out_dir else envs.build_dir()
    lib_path = out / f"{name}_{digest}.so"
    if lib_path.exists():
        return lib_path
    out.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out)
    os.close(fd)
    cmd = [compiler, *flags, str(source), "-o", tmp]
    proc = subprocess.run(cmd, capture_output=not verbose, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"build failed ({' '.join(cmd)}):\n{proc.stderr}")
    os.replace(tmp, lib_path)
    return lib_path


def _source_bytes(source: Path) -> bytes:
    """``source`` and the local headers it includes (``#include "x.h"`` next to it), so a build
    is rebuilt when a header it uses changes."""
    text = source.read_bytes()
    headers = re.findall(rb'^#include "([^"]+)"', text, flags=re.MULTILINE)
    return text + b"".join((source.parent / h.decode()).read_bytes() for h in sorted(headers))


def load(path: Path) -> ctypes.CDLL:
    return ctypes.CDLL(str(path))


def load_cpu_library(source: Path, flags: Sequence[str], name: str, fallback: str
                     ) -> ctypes.CDLL | None:
    """``source`` built by g++ (or c++) with ``flags`` and opened; None, with one warning
    saying ``fallback`` (what runs instead), without a compiler or when the build fails."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        logger.warning("no C++ compiler for %s: %s", name, fallback)
        return None
    try:
        return load(build_shared_library(source, compiler, flags, name))
    except (RuntimeError, OSError) as exc:
        logger.warning("%s unavailable (%s): %s", name, exc, fallback)
        return None
