"""Process tuning (vmkv/process_tuning.py): applied by `LLM(...)`, the CLI and the server, never
by `import vmkv`, with one switch (`VMKV_PROCESS_TUNING=0`) to turn it off.

glibc malloc tuning: a step's temporaries reuse heap memory instead of being page-faulted in
afresh. Measured in one child process by minor page faults (a count, not a time), untuned and
then tuned, over repeated "steps" that allocate and free what a step's activations need; what
this is worth on the real model is in docs/benchmarks.md."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from vmkv import llm as llm_module
from vmkv.config import EngineConfig, ServerConfig
from vmkv.process_tuning import Tuning, tune_process

OPENMP = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")

STEPS = textwrap.dedent("""
    import resource
    import torch
    from vmkv.process_tuning import tune_malloc

    def step(k):  # 8 temporaries live at once, each (8 MiB + k x 256 KiB), then freed
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [torch.empty((32 + k) << 16).fill_(1.0) for _ in range(8)]
        del blocks
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    untuned = [step(k) for k in range(4)]
    tuned = tune_malloc()
    print(tuned, resource.getpagesize(), *untuned, *[step(k) for k in range(4, 10)])
""")


def test_tuned_malloc_reuses_a_step_s_memory_instead_of_faulting_it_in() -> None:
    out = subprocess.run([sys.executable, "-c", STEPS], capture_output=True, text=True,
                         timeout=300, check=True).stdout.split()
    assert out[0] == "True"  # mallopt took every setting
    page = int(out[1])
    faults = [int(n) for n in out[2:]]
    pages = [8 * ((32 + k) << 18) // page for k in range(10)]  # what each step touches
    # Untuned, glibc serves a block larger than any freed before with its own mmap and
    # unmaps it on free (raising its threshold to that size): steps whose temporaries grow a
    # little fault all of them in again.
    assert all(f >= 0.9 * p for f, p in zip(faults[:4], pages[:4], strict=True)), faults
    # Tuned, the heap serves them and keeps what is freed: once it has settled (three steps;
    # the first faulted up to half its memory in), a step faults in about its growth (2 MiB,
    # 6 % of it; measured 0 to 6 %), far from all of it.
    assert all(f < 0.25 * p for f, p in zip(faults[7:], pages[7:], strict=True)), faults


# A child without the OpenMP variables: `mmapped(n)` says whether glibc serves n bytes with a
# mmap of their own (mallinfo2's hblks grows); the block is never freed, since freeing it would
# raise glibc's dynamic threshold and blur the next probe.
_CHILD_HEAD = textwrap.dedent("""
    import ctypes, os, sys

    libc = ctypes.CDLL(None)
    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
                    "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]

    def mmapped(size=24 << 20):
        before = libc.mallinfo2().hblks
        libc.malloc(size)
        return libc.mallinfo2().hblks > before

    def state():
        return [os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")], mmapped()
""")


def _child(body: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in OPENMP}
    out = subprocess.run([sys.executable, "-c", _CHILD_HEAD + textwrap.dedent(body)],
                         env={**base, **env}, capture_output=True, text=True, timeout=120,
                         check=True)
    return out.stdout.strip()


def test_import_vmkv_leaves_the_process_alone_until_tuned_explicitly() -> None:
    out = _child("""
        import vmkv, vmkv.cli, vmkv.config_args, vmkv.llm  # the entry points' modules
        print(state(), "torch" in sys.modules)
        from vmkv.process_tuning import tune_process
        print(tune_process(), state())
    """)
    # importing leaves OpenMP and malloc alone, and loads no torch (so LLM() can still tune)
    assert out.splitlines() == [
        "([None, None], True) False",
        "Tuning(openmp=True, malloc=True) (['PASSIVE', '20000'], False)"]


def test_cli_tunes_before_any_command_and_the_switch_turns_it_off() -> None:
    body = """
        from vmkv.cli import main
        try:
            main(["--help"])
        except SystemExit:
            pass
        print(state())
    """
    assert _child(body).splitlines()[-1] == "(['PASSIVE', '20000'], False)"
    assert _child(body, VMKV_PROCESS_TUNING="0").splitlines()[-1] == "([None, None], True)"


def test_llm_tunes_the_process_then_builds_the_engine_from_its_options(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import vmkv.engine.llm_engine as engine_module

    calls: list[object] = []
    monkeypatch.setattr(llm_module, "tune_process", lambda: calls.append("tune"))
    monkeypatch.setattr(engine_module, "LLMEngine", calls.append)
    llm_module.LLM(kv_mode="paged", max_num_seqs=4)
    assert calls == ["tune", EngineConfig(kv_mode="paged", max_num_seqs=4)]


def test_serve_tunes_the_process_before_loading_the_engine(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from vmkv.server import main as server_main

    calls: list[object] = []

    def engine(config: EngineConfig) -> None:
        calls.append(config)
        raise RuntimeError("stop before serving")

    monkeypatch.setattr(server_main, "tune_process", lambda: calls.append("tune"))
    monkeypatch.setattr(server_main, "LLMEngine", engine)
    with pytest.raises(RuntimeError, match="stop before serving"):
        server_main.serve(EngineConfig(max_num_seqs=2), ServerConfig(port=0))
    assert calls == ["tune", EngineConfig(max_num_seqs=2)]


def test_the_switch_turns_the_tuning_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VMKV_PROCESS_TUNING", "0")
    assert tune_process() == Tuning(openmp=False, malloc=False)
