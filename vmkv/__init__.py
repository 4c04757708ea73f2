"""vmkv: LLM serving with a virtually contiguous KV cache (and a paged mode beside it).

    from vmkv import LLM, SamplingParams
    llm = LLM()                                  # default model, virtual KV mode, CPU
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))

Importing vmkv changes nothing in the process; ``LLM(...)``, the ``vmkv`` command and the server
tune it explicitly (vmkv/process_tuning.py, docs/configuration.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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
