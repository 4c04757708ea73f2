"""Compile a C/C++/CUDA source into a cached shared library and open it with ctypes.

Builds are keyed by the hash of the source and its local headers, and the flags (and, for
``-march=native``, the CPU's instruction sets: a cache directory shared between machines must
not hand an AVX-512 build to a CPU without AVX-512), cached under ``$VMKV_BUILD_DIR`` (default
``~/.cache/vmkv/csrc``) and published with an atomic rename, so concurrent builders never load a
partial file. The libraries have a plain C ABI and link no torch: no torch headers to compile,
no dependence on torch's C++ ABI.

A CPU library that cannot be built (no compiler, a compile error) is not an error for the
engine: :func:`load_cpu_library` logs one warning line naming what runs instead and keeps the
compiler's output (:func:`load_failure`; also saved next to the cache as ``<name>_<hash>.log``),
so the start-up report can say which kernels run and the tests can fail with the build log.
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
#: why each CPU library that did not load failed, by library name (its latest attempt)
_failures: dict[str, str] = {}


class BuildError(RuntimeError):
    """A compiler refused a kernel source; ``output`` is what it printed, also kept in
    ``log`` (a file in the build folder)."""

    def __init__(self, cmd: Sequence[str], output: str, log: Path) -> None:
        super().__init__(f"build failed ({' '.join(cmd)}; log {log}):\n{output}")
        self.output = output
        self.log = log

    def first_error(self) -> str:
        """The compiler's first ``error`` line (else its first line)."""
        lines = [line.strip() for line in self.output.splitlines() if line.strip()]
        errors = [line for line in lines if "error" in line.lower()]
        return (errors or lines or ["no output"])[0]


def build_shared_library(source: Path, compiler: str, flags: Sequence[str], name: str,
                         out_dir: str | Path | None = None, verbose: bool = False) -> Path:
    """Path of ``source`` built with ``compiler flags``; builds it if no cached copy exists.

    Raises :class:`BuildError` (a RuntimeError) with the compiler's output when the build
    fails; the output is also written to ``<name>_<hash>.log`` in the build folder.
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
        log = lib_path.with_suffix(".log")
        output = proc.stderr or "(printed above: verbose build)"
        log.write_text(f"$ {' '.join(cmd)}\n{output}")
        raise BuildError(cmd, output, log)
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
    """``source`` built by g++ (or c++) with ``flags`` and opened; None without a compiler or
    when the build fails, with one warning line saying why and ``fallback`` (what runs
    instead). The whole reason (the compiler's output) is kept for :func:`load_failure`."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        return _failed(name, "no C++ compiler (g++ or c++) on PATH", "", fallback)
    try:
        lib = load(build_shared_library(source, compiler, flags, name))
    except BuildError as exc:
        return _failed(name, str(exc), f"{exc.first_error()} (full log: {exc.log})", fallback)
    except (RuntimeError, OSError) as exc:  # no source tree; built, but the loader refused it
        return _failed(name, str(exc), "", fallback)
    _failures.pop(name, None)
    return lib


def _failed(name: str, reason: str, line: str, fallback: str) -> None:
    """Record why ``name`` did not load and say it in one warning line."""
    _failures[name] = reason
    logger.warning("%s is not available (%s): %s", name, line or reason.splitlines()[0],
                   fallback)


def load_failure(name: str) -> str | None:
    """Why the latest load of the CPU library ``name`` in this process failed (for a build:
    the command and the compiler's whole output); None when it loaded or was never tried."""
    return _failures.get(name)
