"""Process tuning (vmkv/process_tuning.py): applied by `LLM(...)`, the CLI and the server, never
by `import vmkv`, with one switch (`VMKV_PROCESS_TUNING=0`) to turn it off.

glibc malloc tuning: a step's temporaries reuse heap memory instead of being page-faulted in
afresh. Measured in child processes, tuning on and off, by the minor page faults of one
`generate` on the default model (paged mode, so no KV page is faulted in: those are the same
either way)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from vmkv import llm as llm_module
from vmkv.config import EngineConfig, ServerConfig
from vmkv.process_tuning import Tuning, tune_process

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
OPENMP = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")

PROBE = textwrap.dedent("""
    import resource
    from vmkv import LLM, SamplingParams

    llm = LLM(max_model_len=512, kv_mode="paged")  # tunes the process unless VMKV_PROCESS_TUNING=0
    prompts = [[(i * 7 + j) % 5000 + 100 for j in range(20 + 37 * i)] for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    counts = []
    for _ in range(2):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        llm.generate(prompts, params, use_tqdm=False)
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(*counts)
""")


def faults_with(tuning: str) -> tuple[int, int]:
    """Minor faults of two successive measured runs in one child process."""
    # the default engine (compiled layers); eager steps churn less and their counts are noisy
    env = {**os.environ, "VMKV_PROCESS_TUNING": tuning, "VMKV_COMPILE": "1"}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    first, second = out.stdout.strip().splitlines()[-1].split()
    return int(first), int(second)


@pytest.mark.usefixtures("default_model")
def test_tuned_malloc_reuses_memory_instead_of_faulting_it_in() -> None:
    untuned, tuned = faults_with("0")[0], min(faults_with("1"))
    # Untuned, glibc raises its mmap threshold once the first run has freed large blocks, so
    # the churn shows in the first run (later ones fault little): that run is compared. Tuned,
    # a run was now and then ~6,250 faults (2026-12-02, before and after that day's changes:
    # one ~25 MB growth, not per-step churn; the other run ~55), hence the smaller of two.
    # measured (compiled): 41,509 and 94,470 untuned (2026-12-01), 34,380 (2026-12-02),
    # against 54-115 tuned
    assert tuned * 10 < untuned, (tuned, untuned)


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
