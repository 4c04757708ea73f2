"""The one seam every Triton kernel of vmkv is launched through.

    launch(kernel, grid, *args, **constexprs)  ==  kernel[grid](*args, **constexprs)

On a GPU, Triton's launcher asks the driver about the pointer of every tensor argument
(``cuPointerGetAttribute``) and refuses the launch when nothing is mapped at it ("Pointer argument
(at i) cannot be accessed from Triton (cpu tensor?)"): a KV view whose *base* page is unmapped
cannot be passed to a kernel even if the kernel never reads it. vmkv makes that impossible by
construction (each virtual region's first page stays mapped, see :mod:`vmkv.kv.virtual`); this
seam lets tests enforce the same rule without a GPU: :func:`pointer_guard` installs a check that
sees every tensor argument before the launch (the tests' fake driver refuses unmapped addresses
exactly as the real one does).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

#: ``check(argument index, tensor)``; raises to refuse the launch
PointerCheck = Callable[[int, torch.Tensor], None]

_checks: list[PointerCheck] = []


@contextmanager
def pointer_guard(check: PointerCheck) -> Iterator[None]:
    """Run ``check`` on every tensor argument of every launch inside the ``with`` block."""
    _checks.append(check)
    try:
        yield
    finally:
        _checks.remove(check)


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **constexprs: Any) -> None:
    """Launch the Triton ``kernel`` on ``grid`` with ``args`` (after any installed checks)."""
    for check in _checks:
        for index, arg in enumerate(args):
            if isinstance(arg, torch.Tensor):
                check(index, arg)
    kernel[grid](*args, **constexprs)
