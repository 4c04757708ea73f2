"""Test set-up: quiet OpenMP before torch loads (each xdist worker on its share of the cores),
eager engines; `gpu` tests skip without CUDA; the default model; and the skip policy
(tests/skip_policy.py): with ``--only-hardware-skips`` the run fails when any test skipped for a
reason other than missing hardware."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # small torch ops stall ~8 ms otherwise
os.environ.setdefault("GOMP_SPINCOUNT", "20000")  # ...and a short spin saves wake-ups
# engines run eagerly in the suite (compiling every test's model would cost minutes); the tests
# of the compiled path turn it back on with monkeypatch.setenv("VMKV_COMPILE", "1")
os.environ.setdefault("VMKV_COMPILE", "0")
# dtype="auto" means float32 in the suite on every machine (bfloat16 where the CPU has bf16
# hardware otherwise): the equality checks against float32 transformers need it; the bfloat16
# tests ask for bfloat16 explicitly
os.environ.setdefault("VMKV_AUTO_DTYPE", "float32")
# and the default model's weights dequantized (transformers' numbers); the quantization tests
# ask for their formats
os.environ.setdefault("VMKV_QUANTIZATION", "none")
# `make test` runs the files on pytest-xdist workers (one file per worker at a time): each worker
# gets its share of the cores, so two workers' OpenMP teams never contend for the same ones
# (inherited by the servers and replicas the tests launch)
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))

import pytest  # noqa: E402
import skip_policy  # noqa: E402

_skips: list[tuple[str, str]] = []  # (test or module, reason) of every skip this run


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--only-hardware-skips", action="store_true",
                     help="fail the run if a test skips for a reason other than missing "
                          "hardware (tests/skip_policy.py REASONS)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if skip_policy.CUDA:
        return
    skip = pytest.mark.skip(reason=skip_policy.NEEDS_CUDA)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _record_skip(report: pytest.CollectReport | pytest.TestReport) -> None:
    if report.skipped and isinstance(report.longrepr, tuple):
        _skips.append((report.nodeid, str(report.longrepr[2]).removeprefix("Skipped: ")))


pytest_runtest_logreport = pytest_collectreport = _record_skip


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter,
                            config: pytest.Config) -> None:
    if not config.getoption("--only-hardware-skips"):
        return
    reasons: dict[str, int] = {}
    for _, reason in _skips:
        reasons[reason] = reasons.get(reason, 0) + 1
    terminalreporter.section("skips by reason")
    for reason, count in sorted(reasons.items(), key=lambda kv: -kv[1]):
        mark = "ok  " if skip_policy.allowed(reason) else "FAIL"
        terminalreporter.write_line(f"{mark} {count:4d}  {reason}")
    bad = [(node, reason) for node, reason in _skips if not skip_policy.allowed(reason)]
    if bad:
        terminalreporter.write_line(f"{len(bad)} skips name no missing hardware (allowed: "
                                    f"{', '.join(skip_policy.REASONS)}):", red=True)
        for node, reason in bad:
            terminalreporter.write_line(f"  {node}: {reason}", red=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    bad = [s for s in _skips if not skip_policy.allowed(s[1])]
    if bad and session.config.getoption("--only-hardware-skips") and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def default_model():
    """The default model's converted folder; fails (with the install hint) where its wheel is
    missing: the Makefile installs it, so a missing wheel is a broken set-up, not a skip."""
    skip_policy.require_default_model()
    from vmkv.models import resolve_model

    return resolve_model(None, progress=False)


_rss_after_collect = [0]  # the process's resident bytes after the last collection


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(autouse=True)
def _collect_cycles_when_memory_grew():
    """Collect cyclic garbage after a test that left the process 256 MiB larger than after the
    last collection. Engines free their weights and KV on close or by reference counting; what
    libraries keep in cycles (compiled graphs, servers' routes, tracebacks) would otherwise wait
    for the collector's rare full passes while the next tests build their engines."""
    yield
    if _resident_bytes() - _rss_after_collect[0] > 256 << 20:
        import gc

        gc.collect()
        _rss_after_collect[0] = _resident_bytes()
