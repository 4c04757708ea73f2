"""int8 weights from any model (``--quantization int8|w8a8``): each decoder linear's weight
quantised to int8 at load, the LM head and the norms kept in the engine's dtype.

    int8   per block of 32 inputs of a row: w = s q, q int8 in [-127, 127], s = fp16(max|w| /
           127): GGUF's Q8_0 of the weight, in the quantized kernels' layout
           (vmkv.kernels.cpu_quant), so the fused layers, the one-user decode loop and the
           prefill tiles run on it; activations as those kernels take them. A per-output-channel
           scale would take the same bytes (the layout stores a scale per block either way) and
           agreed less with the model: 96.3 % of 2,044 teacher-forced top-1 tokens of the
           float32 default model against 97.7 % per block (docs/models.md, "Quantized weights")
    w8a8   per output channel, ``w[n] = s[n] q[n]``, as torch int8 ``[N, K]``; activations
           quantised per token to int8 (s_t = max|x[t]| / 127) and multiplied by torch's
           ``_int_mm`` (int8 x int8 -> int32), rescaled by s_t s[n]: the dynamic W8A8 scheme of
           vLLM's CPU backend (``_int_mm`` takes one scale per output, not per block); the
           loader smooths the activations' outlier channels into the weights first
           (:mod:`vmkv.models.quant.smooth`)

Why these kernels, measured on the 2-core Zen 4 EPYC (one gate|up projection, 3072 x 576):
torch's weight-only ``_weight_int8pack_mm`` took 4.3 ms for one float32 row and 111 us for one
bfloat16 row, slower than the dense bf16 linear at every row count from 8 up; its ``_int_mm``
with per-token quantisation around it beat the dense linear at 1-512 rows (``w8a8``); the
quantized kernels' Q8_0 product streams the same int8 bytes (docs/models.md, "int8 weights").
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from vmkv.models.quant.modules import QuantLinear, QuantTensor
from vmkv.models.quant.packing import BLOCK

INT8_MODES = ("int8", "w8a8")
Q8_0 = 8  # the GGML type id of Q8_0


def channel_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` -> (int8 codes ``[N, K]``, float16 scales ``[N]``): each row's codes
    ``round(w / s)`` with ``s = fp16(max|w| / 127)`` (0 rows: scale 0)."""
    w = weight.detach().to(torch.float32)
    scale = (w.abs().amax(dim=1) / 127).to(torch.float16)
    s = scale.to(torch.float32)
    codes = torch.where(s[:, None] > 0, torch.round(w / torch.where(s > 0, s, 1)[:, None]), 0)
    return codes.clamp(-127, 127).to(torch.int8), scale


def int8_tensor(weight: torch.Tensor) -> QuantTensor:
    """``weight [N, K]`` in int8 per block of 32 inputs (:func:`channel_int8` of each block:
    GGUF's Q8_0) as a :class:`QuantTensor`."""
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"int8 weights need in_features divisible by {BLOCK}, got {k}")
    blocks = k // BLOCK
    codes, scale = channel_int8(weight.reshape(n * blocks, BLOCK))  # a block per row
    raw = np.empty((n, blocks, 34), dtype=np.uint8)  # GGUF Q8_0: fp16 d, then 32 int8 codes
    raw[..., :2] = scale.numpy().view(np.uint8).reshape(n, blocks, 2)
    raw[..., 2:] = codes.numpy().view(np.uint8).reshape(n, blocks, BLOCK)
    packed = QuantTensor.from_gguf(raw.reshape(n, -1), Q8_0, k)
    return QuantTensor(packed.packed, Q8_0, n, k, origin="int8")


class W8A8Linear(nn.Module):
    """``y = x W^T + b`` with ``W`` int8 per output channel and ``x`` quantised per token to int8
    (:func:`torch._int_mm`); the output in x's dtype."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        codes, scale = channel_int8(linear.weight)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("codes_t", codes.t(), persistent=False)  # [K, N] view of [N, K]
        self.register_buffer("scale", scale.to(torch.float32), persistent=False)
        bias = linear.bias.detach() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, K] -> [T, N]
        xf = x.to(torch.float32)
        step = xf.abs().amax(dim=1, keepdim=True) / 127  # [T, 1]
        xq = torch.round(xf / torch.where(step > 0, step, 1)).to(torch.int8)
        y = torch._int_mm(xq, self.codes_t).to(torch.float32) * step * self.scale  # [T, N]
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)


def quantize_linears(model: nn.Module, mode: str) -> int:
    """Swap every decoder layer's ``nn.Linear`` (not the LM head) for its ``mode`` form
    (:data:`INT8_MODES`); returns how many were swapped."""
    if mode not in INT8_MODES:
        raise ValueError(f"int8 quantization is one of {INT8_MODES}, got {mode!r}")
    swapped = 0
    for layer in getattr(model, "layers", []):
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if not isinstance(child, nn.Linear) or child.weight.device.type != "cpu":
                    continue
                if mode == "w8a8":
                    new: nn.Module = W8A8Linear(child)
                else:
                    bias = child.bias.detach() if child.bias is not None else None
                    new = QuantLinear([int8_tensor(child.weight)], bias)
                setattr(parent, name, new)
                swapped += 1
    return swapped
