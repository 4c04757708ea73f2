"""Which CPU kernel libraries (``csrc/cpu_*.cpp``) run in this process, and what runs instead of
one that did not build: read by the engine's start-up report and the server's ``/health``.

    status()  {"attention": "compiled", "argmax": "compiled", "quant_layers": "compiled",
               "decoder_layers": "not built: the decoder layers run as torch modules"}

Asking builds each library on its first use (cached on disk: 1-8 s each the first
time on a machine, nothing afterwards); a library that cannot be built has already said why in
one warning line (:func:`vmkv.kernels.build.load_cpu_library`).
"""

from __future__ import annotations

from types import ModuleType

from vmkv.cpu_info import bf16_hardware
from vmkv.kernels import cpu_argmax, cpu_attention, cpu_bf16, cpu_decoder_layer, cpu_quant

#: each CPU kernel by the name the reports use; each module has ``available()`` and ``FALLBACK``
#: (the bfloat16 layers only where the CPU has bfloat16 hardware: nowhere else do they build)
KERNELS: dict[str, ModuleType] = {"attention": cpu_attention, "argmax": cpu_argmax,
                                  "decoder_layers": cpu_decoder_layer, "quant_layers": cpu_quant,
                                  **({"bf16_layers": cpu_bf16} if bf16_hardware() else {})}
COMPILED = "compiled"


def status() -> dict[str, str]:
    """``"compiled"``, or ``"not built: <what runs instead>"``, for each of :data:`KERNELS`."""
    return {name: COMPILED if module.available() else f"not built: {module.FALLBACK}"
            for name, module in KERNELS.items()}


def report_line() -> str:
    """:func:`status` in one line for the start-up report."""
    states = status()
    built = [name.replace("_", " ") for name, state in states.items() if state == COMPILED]
    missing = [f"{name.replace('_', ' ')} {state}" for name, state in states.items()
               if state != COMPILED]
    line = f"CPU kernels: {', '.join(built) or 'none'} compiled"
    return line + (f"; {'; '.join(missing)} (see the warning above)" if missing else "")
