"""Every environment variable vmkv reads, with its default and meaning.

This is the only module that reads ``os.environ`` (``vmkv/process_tuning.py`` is the one that
writes it). Values are read when an accessor is called, never at import, so a variable set later
(``monkeypatch.setenv`` in a test, a wrapper script) takes effect. An empty value counts as
unset. Switches are on unless set to ``0``, ``false``, ``no`` or ``off``.

``docs/configuration.md`` carries :func:`table` verbatim (a test checks it); regenerate it with
``python -m vmkv.envs``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: its name, the value used when it is unset, what it does.

    ``tuned`` is the value vmkv's process tuning (:func:`vmkv.process_tuning.tune_process`)
    puts in the environment when the variable is unset; None for variables it leaves alone.
    """

    name: str
    default: str | None
    meaning: str
    tuned: str | None = None

    def get(self) -> str | None:
        """The variable's value, or ``default`` when it is unset or empty."""
        return os.environ.get(self.name) or self.default


VMKV_ATTENTION_BACKEND = EnvVar(
    "VMKV_ATTENTION_BACKEND", "auto",
    "default of `--attention-backend` (the CUDA attention kernel): auto, flash, flash-attn, "
    "aten-flash, triton or sdpa (docs/gpu.md)")
VMKV_CUDA_GRAPHS = EnvVar(
    "VMKV_CUDA_GRAPHS", "1",
    "default of `--cuda-graphs`: CUDA engines capture their decode steps as CUDA graphs (unless "
    "`--enforce-eager`); 0: every step runs eagerly")
VMKV_COMPILE = EnvVar(
    "VMKV_COMPILE", "1",
    "default of `--compile-layers`: CPU engines compile their decoder layers with TorchInductor "
    "(unless `--enforce-eager`); 0: engines built without the option run eagerly (the test "
    "suite sets it)")
VMKV_AUTO_DTYPE = EnvVar(
    "VMKV_AUTO_DTYPE", None,
    "what `--dtype auto` resolves to (float32 or bfloat16); unset: bfloat16 on CUDA and on CPUs "
    "with bfloat16 hardware, float32 on other CPUs (the test suite sets float32, so its "
    "equality checks against float32 transformers hold on every machine)")
VMKV_QUANTIZATION = EnvVar(
    "VMKV_QUANTIZATION", "none",
    "default of `--quantization`: none, auto, gguf, int8 or w8a8; none until the GGUF formats "
    "also win on prefill and batched decode (docs/models.md, \"Quantized weights\"); the test "
    "suite sets none too, so its equality checks against the dequantized float32 model and "
    "transformers hold, and its quantization tests ask for their formats")
VMKV_QUANT_I16_TILE_ROWS = EnvVar(
    "VMKV_QUANT_I16_TILE_ROWS", "8",
    "AVX2 CPUs without AVX-512: products on GGUF or int8 blocks of at least this many rows "
    "multiply the blocks widened into int16 tiles by vpmaddwd (csrc/cpu_quant_i16_tiles.h; the "
    "same results; docs/models.md, \"Quantized weights\"); 0: the integer products at every "
    "row count")
VMKV_FUSED_LAYERS = EnvVar(
    "VMKV_FUSED_LAYERS", "1",
    "default of `--fused-layers`: CPU engines (float32 with MKL or brgemm linears, bfloat16 "
    "with brgemm ones) run each decoder layer but its attention as two C++ calls "
    "(csrc/cpu_decoder_layer.cpp, cpu_bf16_layer.cpp); 0: off")
VMKV_BACKGROUND_MAPPER = EnvVar(
    "VMKV_BACKGROUND_MAPPER", "1",
    "default of `--background-mapper`: virtual mode on CUDA maps the next steps' pages on a "
    "thread while the GPU computes; 0: map inline")
VMKV_PROCESS_TUNING = EnvVar(
    "VMKV_PROCESS_TUNING", "1",
    "the CLI, `LLM` and the server tune the process (OpenMP defaults below, glibc malloc "
    "thresholds); 0: leave the process alone")
VMKV_API_KEY = EnvVar(
    "VMKV_API_KEY", None,
    "default of `--api-key` (`vmkv serve`, `vmkv bench serve`); unset: no key")
VMKV_SERVER_DEV_MODE = EnvVar(
    "VMKV_SERVER_DEV_MODE", "0",
    "default of `--dev-mode`: 1: `vmkv serve` also offers its development routes "
    "(`POST /reset_prefix_cache`), as vLLM does with `VLLM_SERVER_DEV_MODE=1`; unset or 0: "
    "they answer 404")
VMKV_CACHE = EnvVar(
    "VMKV_CACHE", "~/.cache/vmkv", "converted models (`<VMKV_CACHE>/models/`)")
VMKV_BUILD_DIR = EnvVar(
    "VMKV_BUILD_DIR", "~/.cache/vmkv/csrc", "compiled C++/CUDA kernels (csrc/)")
CUDA_HOME = EnvVar(
    "CUDA_HOME", "/usr/local/cuda", "where `nvcc` is looked for when it is not on PATH")
VMKV_TP_CHECK = EnvVar(
    "VMKV_TP_CHECK", "0",
    "default of `--tp-check`, tensor parallelism's debug mode: after every step each rank "
    "sends rank 0 a digest of its KV manager (slot ids or block tables, token counts, free "
    "pages/blocks); a difference fails the engine")
RANK = EnvVar("RANK", None, "`vmkv tp-worker`: this process's tensor-parallel rank (torchrun's "
              "convention)")
WORLD_SIZE = EnvVar("WORLD_SIZE", None, "`vmkv tp-worker`: all ranks (= the engine's "
                    "`--tensor-parallel-size`)")
LOCAL_RANK = EnvVar("LOCAL_RANK", "0", "`vmkv tp-worker`: this rank's index on its machine "
                    "(picks its GPU)")
MASTER_ADDR = EnvVar("MASTER_ADDR", None, "`env://` rendezvous: rank 0's address (read by "
                     "torch.distributed)")
MASTER_PORT = EnvVar("MASTER_PORT", None, "`env://` rendezvous: rank 0's port (read by "
                     "torch.distributed)")
OMP_WAIT_POLICY = EnvVar(
    "OMP_WAIT_POLICY", None,
    "OpenMP idle threads; read once, when torch loads its OpenMP runtime. PASSIVE: idle threads "
    "do not burn a core (see Process tuning for what it saves)", tuned="PASSIVE")
GOMP_SPINCOUNT = EnvVar(
    "GOMP_SPINCOUNT", None,
    "how long an idle OpenMP thread spins before sleeping; read when torch loads. A short spin "
    "saves a step's back-to-back small ops a wake-up each (see Process tuning)",
    tuned="20000")

#: every variable, in the order docs/configuration.md lists them
ALL: tuple[EnvVar, ...] = (
    VMKV_ATTENTION_BACKEND, VMKV_CUDA_GRAPHS, VMKV_COMPILE, VMKV_AUTO_DTYPE, VMKV_QUANTIZATION,
    VMKV_QUANT_I16_TILE_ROWS, VMKV_FUSED_LAYERS,
    VMKV_BACKGROUND_MAPPER,
    VMKV_PROCESS_TUNING,
    VMKV_API_KEY, VMKV_SERVER_DEV_MODE, VMKV_CACHE, VMKV_BUILD_DIR, CUDA_HOME, VMKV_TP_CHECK,
    RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, OMP_WAIT_POLICY, GOMP_SPINCOUNT,
)

_OFF = ("0", "false", "no", "off")


def switch(var: EnvVar) -> bool:
    """A switch's value: on unless set to 0, false, no or off."""
    return (var.get() or "").strip().lower() not in _OFF


def auto_dtype() -> str | None:
    """What ``dtype="auto"`` resolves to when forced (``VMKV_AUTO_DTYPE``), else None."""
    value = VMKV_AUTO_DTYPE.get()
    if value not in (None, "float32", "bfloat16"):
        raise ValueError(f"VMKV_AUTO_DTYPE must be float32 or bfloat16, got {value!r}")
    return value


def quant_i16_tile_rows() -> int:
    """``VMKV_QUANT_I16_TILE_ROWS`` as a row count (ValueError: not a whole number >= 0)."""
    value = VMKV_QUANT_I16_TILE_ROWS.get() or ""
    if not value.isdigit():
        raise ValueError(f"VMKV_QUANT_I16_TILE_ROWS must be a whole number >= 0, got {value!r}")
    return int(value)


def torchrun_rank() -> tuple[int, int, int]:
    """``(RANK, WORLD_SIZE, LOCAL_RANK)`` for ``vmkv tp-worker``; ValueError when unset."""
    rank, size = RANK.get(), WORLD_SIZE.get()
    if rank is None or size is None:
        raise ValueError("vmkv tp-worker needs RANK and WORLD_SIZE (and MASTER_ADDR, "
                         "MASTER_PORT) in the environment")
    return int(rank), int(size), int(LOCAL_RANK.get() or 0)


def process_tuning() -> bool:
    return switch(VMKV_PROCESS_TUNING)


def api_key() -> str | None:
    return VMKV_API_KEY.get()


def cache_dir() -> Path:
    return Path(VMKV_CACHE.get() or "").expanduser()


def build_dir() -> Path:
    return Path(VMKV_BUILD_DIR.get() or "").expanduser()


def cuda_home() -> str:
    return CUDA_HOME.get() or ""


def omp_wait_policy() -> str | None:
    """The value in the environment now (None: unset), as recorded with benchmark results."""
    return OMP_WAIT_POLICY.get()


def child_environment(**overrides: str) -> dict[str, str]:
    """This process's environment with ``overrides``, for a child process (benchmarks)."""
    return {**os.environ, **overrides}


def table() -> str:
    """The Markdown table of :data:`ALL` that docs/configuration.md carries."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for var in ALL:
        default = "unset" if var.default is None else f"`{var.default}`"
        if var.tuned is not None:
            default += f" (process tuning: `{var.tuned}`)"
        rows.append(f"| `{var.name}` | {default} | {var.meaning} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(table(), end="")
