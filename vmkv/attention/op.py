"""Attention as one opaque operator, so that a compiler can take the model around it.

    with attention_step(backend, meta):                 (the model sets the step's attention)
        out = attention(q, k, v, scale)                 [T, Hq*D], layer 0, then 1, 2, ...

Run eagerly, :func:`attention` calls the step's backend directly. Under ``torch.compile`` it is
the custom op ``vmkv::attention``: the compiler sees only the output's shape, so the backends'
kernels (the C++ decode kernel and SDPA on the CPU; FlashAttention and the Triton twins on CUDA)
run unmodified on either KV mode, and their K/V write into the cache, which no graph input
holds, stays outside the graph.

The layer is not an argument: the step counts the calls (the first is layer 0). Each layer's
input depends on the previous layer's attention output, so the calls keep the layers' order in
eager mode, in compiled code and in a captured CUDA graph alike; and one compiled decoder layer
then serves every layer (an integer argument would be a constant to the compiler, one graph per
layer).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from vmkv.attention.base import AttentionBackend, AttentionMetadata

_step = threading.local()


class _Step:
    """The attention of one model step: its backend and metadata, and the next layer."""

    def __init__(self, backend: AttentionBackend, meta: AttentionMetadata) -> None:
        self.backend = backend
        self.meta = meta
        self.layer = 0


@contextmanager
def attention_step(backend: AttentionBackend, meta: AttentionMetadata) -> Iterator[None]:
    """Make ``backend`` and ``meta`` the attention of every :func:`attention` call inside;
    the calls are layers 0, 1, 2, ... in order."""
    outer = getattr(_step, "current", None)
    _step.current = _Step(backend, meta)
    try:
        yield
    finally:
        _step.current = outer


def current_step() -> tuple[AttentionBackend, AttentionMetadata] | None:
    """The backend and metadata of the :func:`attention_step` in force (None outside one):
    for code that runs a whole step's layers itself (vmkv.models.quant.decode_loop)."""
    step = getattr(_step, "current", None)
    return None if step is None else (step.backend, step.meta)


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    step = getattr(_step, "current", None)
    if step is None:
        raise RuntimeError("attention called outside attention_step(backend, meta)")
    layer, step.layer = step.layer, step.layer + 1
    return step.backend.forward(layer, q, k, v, step.meta, scale)


@torch.library.custom_op("vmkv::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                  ) -> torch.Tensor:
    return _run(q, k, v, scale)


@_attention_op.register_fake
def _attention_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                     ) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Write ``k, v [T, Hkv, D]`` into the next layer's cache and attend with
    ``q [T, Hq, D]``; returns ``[T, Hq * D]`` (the step's backend: :func:`attention_step`)."""
    if torch.compiler.is_compiling():
        return torch.ops.vmkv.attention(q, k, v, scale)
    return _run(q, k, v, scale)
