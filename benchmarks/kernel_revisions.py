"""A kernel source as committed at another git revision, for benchmarks that build it beside the
working tree's and time both in one process (``int8_decode_ab.py``, ``quant_layer_ab.py``): on a
machine whose speed wanders between runs, only builds alternated in one sitting compare."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from vmkv.kernels.build import CSRC

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
