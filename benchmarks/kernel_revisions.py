"""A kernel source as committed at another git revision, for benchmarks that build it beside the
working tree's and time both in one process (``int8_decode_ab.py``, ``quant_layer_ab.py``): on a
machine whose speed wanders between runs, only builds alternated in one sitting compare."""

from __future__ import annotations

import ctypes
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vmkv.cpu_info import cpu_features, cpu_model
from vmkv.kernels.build import CPU_FLAGS, CSRC

#: the flags a result's machine names
VECTOR_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16")

_INCLUDE = re.compile(r'^#include "([^"]+)"', flags=re.MULTILINE)


def source_at(source: Path, revision: str, folder: Path) -> Path:
    """``source`` (a file in csrc/) and every local header it includes, directly or through
    another header, as committed at ``revision``, written to ``folder``; the source's copy.
    SystemExit (one line) when the revision lacks one of them."""
    def show(name: str) -> str:
        done = subprocess.run(["git", "show", f"{revision}:csrc/{name}"], cwd=CSRC.parent,
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"--base {revision}: no csrc/{name} there ({done.stderr.strip()})")
        return done.stdout

    pending, written = [source.name], set()
    while pending:
        name = pending.pop()
        if name in written:
            continue
        text = show(name)
        (folder / name).write_text(text)
        written.add(name)
        pending.extend(_INCLUDE.findall(text))
    return folder / source.name


def builds(build: Callable[..., ctypes.CDLL | None], source: Path, base: str, folder: Path
           ) -> dict[str, ctypes.CDLL]:
    """``{base: the library built from source as committed at base, "tree": the working tree's}``,
    both with the engine's flags (``build(flags, source)``: a kernel module's build); SystemExit
    when either build fails."""
    at_base, tree = build(CPU_FLAGS, source_at(source, base, folder)), build(CPU_FLAGS, source)
    if at_base is None or tree is None:
        raise SystemExit("a build failed (see the warning above)")
    return {base: at_base, "tree": tree}


def machine() -> dict[str, Any]:
    """The CPU model and its vector flags, for a result's JSON."""
    flags = cpu_features().split()
    return {"cpu": cpu_model(), "flags": [f for f in VECTOR_FLAGS if f in flags]}
