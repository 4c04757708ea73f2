"""Triton is a dev dependency on Linux (pyproject), so its tests must run there: a missing or
broken install fails them instead of skipping them. Elsewhere they skip when it is absent."""

from __future__ import annotations

import importlib.util
import sys

import pytest

EXPECTED = sys.platform.startswith("linux")
INSTALLED = importlib.util.find_spec("triton") is not None

#: whether the tests run their triton cases (a missing install then fails them on Linux)
USE = EXPECTED or INSTALLED

#: mark for tests that need triton (skips only where it is not a declared dependency)
needs_triton = pytest.mark.skipif(not USE,
                                  reason="triton is not installed (not a dependency here)")
