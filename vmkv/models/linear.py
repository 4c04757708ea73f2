"""CPU linear layers through oneDNN with weights packed once at load time.

torch's default CPU ``F.linear`` (sgemm) reaches ~100-120 GFLOP/s on this project's 2-core AVX2
machines at decode batch sizes; oneDNN's ``_linear_pointwise`` on a weight reordered once into
its blocked layout reaches ~170-200 (measured, docs/benchmarks.md). The results differ from
sgemm's only by float reassociation (~1e-6 relative). Used for float32 on the CPU when torch
has the oneDNN ops (``linear_backend="auto"``); ``"torch"`` keeps plain ``F.linear``.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from vmkv.config import LINEAR_BACKENDS

logger = logging.getLogger(__name__)


def onednn_available() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` in oneDNN's packed layout (inference only, float32)."""

    def __init__(self, linear: nn.Linear, batch_hint: int) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)
        self.register_buffer("packed_weight", packed, persistent=False)
        bias = linear.bias.detach() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in_features] -> [T, out_features]
        if torch.compiler.is_compiling():  # opaque to Inductor: the packed call as it is
            return torch.ops.vmkv.packed_linear(x, self.packed_weight, self.bias,
                                                self.out_features)
        return _onednn_linear(x, self.packed_weight, self.bias)


def _onednn_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None
                   ) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


@torch.library.custom_op("vmkv::packed_linear", mutates_args=())
def _packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                   out_features: int) -> torch.Tensor:
    """oneDNN's linear on a weight packed by ``_reorder_linear_weight`` (Inductor has no
    lowering for a weight packed outside it, so compiled code calls this op)."""
    return _onednn_linear(x, packed_weight, bias)


@_packed_linear.register_fake
def _packed_linear_shape(x: torch.Tensor, packed_weight: torch.Tensor,
                         bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


def pack_linears(model: nn.Module, backend: str = "auto", batch_hint: int = 64) -> int:
    """Swap ``model``'s float32 CPU ``nn.Linear`` layers for :class:`PackedLinear`; returns how
    many were swapped (0 for other devices/dtypes or ``backend="torch"``)."""
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {backend!r}")
    if backend == "torch":
        return 0
    if not onednn_available():
        if backend == "onednn":
            raise ValueError("linear_backend='onednn' needs torch built with oneDNN (mkldnn)")
        return 0
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (isinstance(child, nn.Linear) and child.weight.device.type == "cpu"
                    and child.weight.dtype == torch.float32):
                setattr(parent, name, PackedLinear(child, batch_hint))
                swapped += 1
    logger.debug("packed %d linear layers for oneDNN", swapped)
    return swapped
