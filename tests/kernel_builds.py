"""The CPU kernels' code paths as builds a test chooses: ``native`` (-march=native: AVX-512 or
AVX2 intrinsics, whichever the CPU has), ``no-avx512`` (the AVX2 paths, also on AVX-512
machines) and ``portable`` (the plain loops)."""

from __future__ import annotations

from types import ModuleType

import pytest
from skip_policy import NEEDS_X86, X86_64, require

from vmkv.kernels.build import CPU_FLAGS, load_failure

BUILDS = {"native": (), "no-avx512": ("-mno-avx512f",),
          "portable": ("-mno-avx512f", "-mno-avx2", "-mno-fma")}


def use_build(module: ModuleType, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``module``'s kernels (what its ``_lib()`` returns) the ``name`` build of
    ``module.build``: skipped off x86 (the switches are x86's), failed where it does not build."""
    if name != "native" and not X86_64:
        pytest.skip(f"{NEEDS_X86}: the {name} build")
    flags = (*getattr(module, "FLAGS", CPU_FLAGS), *BUILDS[name])
    require(lambda: module.build(flags) is not None, f"the {name} build of {module.LIBRARY}",
            lambda: load_failure(module.LIBRARY))
    monkeypatch.setattr(module, "_lib", lambda: module.build(flags))
