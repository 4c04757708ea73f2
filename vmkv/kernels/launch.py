"""The one seam every Triton kernel of vmkv is launched through.

    launch(kernel, grid, *args, **constexprs)  ==  kernel[grid](*args, **constexprs)

On a GPU, Triton's launcher asks the driver about the pointer of every tensor argument
(``cuPointerGetAttribute``) and refuses the launch when nothing is mapped at it ("Pointer argument
(at i) cannot be accessed from Triton (cpu tensor?)"): a KV view whose *base* page is unmapped
cannot be passed to a kernel even if the kernel never reads it. vmkv makes that impossible by
construction (each virtual region's first page stays mapped, see :mod:`vmkv.kv.virtual`); this
seam lets tests enforce the same rule without a GPU: :func:`pointer_guard` installs a check that
sees every tensor argument before the launch (the tests' fake driver refuses unmapped addresses
exactly as the real one does). :func:`launch_through` hands the launches to a test's runner
instead (the tests' CPU double of a CUDA graph records a capture's launches to repeat them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

#: ``check(argument index, tensor)``; raises to refuse the launch
PointerCheck = Callable[[int, torch.Tensor], None]

#: ``run(kernel, grid, args, constexprs)``: launches in place of ``kernel[grid](...)``
Launcher = Callable[[Any, tuple[int, ...], tuple[Any, ...], dict[str, Any]], None]

_checks: list[PointerCheck] = []
_launchers: list[Launcher] = []


@contextmanager
def pointer_guard(check: PointerCheck) -> Iterator[None]:
    """Run ``check`` on every tensor argument of every launch inside the ``with`` block."""
    _checks.append(check)
    try:
        yield
    finally:
        _checks.remove(check)


@contextmanager
def launch_through(run: Launcher) -> Iterator[None]:
    """Make ``run`` do every launch inside the ``with`` block (after the checks)."""
    _launchers.append(run)
    try:
        yield
    finally:
        _launchers.remove(run)


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **constexprs: Any) -> None:
    """Launch the Triton ``kernel`` on ``grid`` with ``args`` (after any installed checks)."""
    for check in _checks:
        for index, arg in enumerate(args):
            if isinstance(arg, torch.Tensor):
                check(index, arg)
    if _launchers:
        _launchers[-1](kernel, grid, args, constexprs)
        return
    kernel[grid](*args, **constexprs)
