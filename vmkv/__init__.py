"""vmkv: LLM serving with a virtually contiguous KV cache (and a paged mode beside it).

    from vmkv import LLM, SamplingParams
    llm = LLM()                                  # default model, virtual KV mode, CPU
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# OpenMP waiting, read once when torch loads its OpenMP runtime (so set before importing torch):
# PASSIVE keeps idle threads from burning a core, and a short spin (GOMP_SPINCOUNT) keeps the
# back-to-back small ops of a step from paying a thread wake-up each: measured on a 2-core
# machine, a [64, 576] multiply takes 49 µs with PASSIVE alone and 6 µs with both, and a
# SmolLM2 decode step of 64 requests 187 ms vs 159 ms (docs/benchmarks.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "20000")

from vmkv.malloc_tuning import tune_malloc  # noqa: E402 - after the OpenMP settings

tune_malloc()  # activations from the heap, not fresh mmaps (VMKV_MALLOC_TUNING=0: off)

__version__ = "0.1.0"

if TYPE_CHECKING:
    from vmkv.llm import LLM
    from vmkv.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:  # lazy: `import vmkv` stays cheap
    if name == "LLM":
        from vmkv.llm import LLM

        return LLM
    if name == "SamplingParams":
        from vmkv.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'vmkv' has no attribute {name!r}")
