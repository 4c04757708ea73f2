"""glibc malloc tuning at `import vmkv` (vmkv/malloc_tuning.py): a step's temporaries reuse heap
memory instead of being page-faulted in afresh. Measured in child processes, tuning on and off,
by the minor page faults of one `generate` on the default model (paged mode, so no KV page is
faulted in: those are the same either way)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.usefixtures("default_model"),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")]

PROBE = textwrap.dedent("""
    import resource
    import vmkv  # applies the tuning unless VMKV_MALLOC_TUNING=0
    from vmkv import LLM, SamplingParams

    llm = LLM(max_model_len=512, kv_mode="paged")
    prompts = [[(i * 7 + j) % 5000 + 100 for j in range(20 + 37 * i)] for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    llm.generate(prompts, params, use_tqdm=False)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def faults_with(tuning: str) -> int:
    env = {**os.environ, "VMKV_MALLOC_TUNING": tuning}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def test_tuned_malloc_reuses_memory_instead_of_faulting_it_in() -> None:
    untuned, tuned = faults_with("0"), faults_with("1")
    # measured: ~306,000 against ~6,300
    assert tuned * 10 < untuned, (tuned, untuned)
