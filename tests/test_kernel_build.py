"""A CPU kernel library that does not build (vmkv/kernels/build.py): the engine's fallback says
so in one warning line, the start-up report and /health name what runs instead, and the tests
that need the library fail with the compiler's output instead of skipping."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
from skip_policy import require_cpu_kernel

from vmkv.kernels import cpu_attention, cpu_kernels
from vmkv.kernels.build import CPU_FLAGS, load_cpu_library, load_failure

BROKEN = "int vmkv_broken() { return not_declared_anywhere; }\n"
GOOD = 'extern "C" int vmkv_fine() { return 7; }\n'


@pytest.fixture
def sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("VMKV_BUILD_DIR", str(tmp_path / "build"))
    (tmp_path / "broken.cpp").write_text(BROKEN)
    (tmp_path / "fine.cpp").write_text(GOOD)
    return tmp_path


def test_a_failed_build_is_one_warning_line_and_keeps_the_compiler_output(
        sources: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="vmkv"):
        lib = load_cpu_library(sources / "broken.cpp", CPU_FLAGS, "vmkv_test_broken",
                               "plain torch instead")
    assert lib is None
    (record,) = caplog.records
    line = record.getMessage()
    assert "\n" not in line and line.startswith("vmkv_test_broken is not available (")
    assert "not_declared_anywhere" in line and line.endswith("): plain torch instead")
    log = Path(line[line.index("full log: ") + 10 : line.rindex("))")])
    assert log.parent == sources / "build" and "not_declared_anywhere" in log.read_text()
    failure = load_failure("vmkv_test_broken")
    assert failure is not None and "broken.cpp" in failure and "error" in failure
    # the tests that need such a library fail, with that output
    module = SimpleNamespace(available=lambda: False, LIBRARY="vmkv_test_broken",
                             SOURCE=sources / "broken.cpp")
    with pytest.raises(pytest.fail.Exception, match="(?s)vmkv_test_broken.*cannot run.*"
                                                    "not_declared_anywhere"):
        require_cpu_kernel(module)


def test_a_library_that_builds_later_clears_its_failure(sources: Path) -> None:
    assert load_cpu_library(sources / "broken.cpp", CPU_FLAGS, "vmkv_test_fix", "x") is None
    assert load_failure("vmkv_test_fix") is not None
    lib = load_cpu_library(sources / "fine.cpp", CPU_FLAGS, "vmkv_test_fix", "x")
    assert lib is not None and lib.vmkv_fine() == 7 and load_failure("vmkv_test_fix") is None


def test_no_compiler_is_a_failure_too(sources: Path, monkeypatch: pytest.MonkeyPatch,
                                      caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("PATH", str(sources))  # no g++ / c++
    with caplog.at_level(logging.WARNING, logger="vmkv"):
        assert load_cpu_library(sources / "fine.cpp", CPU_FLAGS, "vmkv_test_cc", "x") is None
    assert load_failure("vmkv_test_cc") == "no C++ compiler (g++ or c++) on PATH"
    assert caplog.messages == ["vmkv_test_cc is not available (no C++ compiler (g++ or c++) "
                               "on PATH): x"]


def test_the_reports_say_which_kernels_run(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu_kernels.status() == dict.fromkeys(cpu_kernels.KERNELS, "compiled")
    bf16 = ", bf16 layers" if "bf16_layers" in cpu_kernels.KERNELS else ""  # bf16 hardware
    assert cpu_kernels.report_line() == (
        f"CPU kernels: attention, argmax, decoder layers, quant layers{bf16} compiled")
    monkeypatch.setattr(cpu_attention, "available", lambda: False)
    assert cpu_kernels.status()["attention"] == "not built: per-request SDPA instead"
    assert cpu_kernels.report_line() == (
        f"CPU kernels: argmax, decoder layers, quant layers{bf16} compiled; attention not "
        "built: per-request SDPA instead (see the warning above)")
