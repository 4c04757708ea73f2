"""int8 weights from any model (``--quantization int8|w8a8``): each decoder linear's weight
quantised to int8 at load, the LM head and the norms kept in the engine's dtype.

    int8   per block of 32 inputs of a row, asymmetric: w = d u + m, u in [0, 255], d =
           fp16((max w - m) / 255), m = fp16(min w) (vmkv's U8 block: Q4_1's scheme at 8 bits),
           in the quantized kernels' layout (vmkv.kernels.cpu_quant), so the fused layers, the
           one-user decode loop and the prefill tiles run on it; activations as those kernels
           take them. The minimum costs 2 bytes a block (36 against Q8_0's 34) and spends all
           256 levels on the block's own range: on the default model (whose weights came from a
           Q4_1 file, 16 levels a block) 99.6 % of 2,044 teacher-forced top-1 tokens of the
           float32 model against 97.5 % for the symmetric Q8_0 grid (s = max|w| / 127) and
           96.3 % for one scale per output channel (docs/models.md, "Quantized weights")
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
quantized kernels' U8 product streams int8 codes too (docs/models.md, "int8 weights").
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from vmkv.models.quant.modules import QuantLinear, QuantTensor
from vmkv.models.quant.packing import BLOCK, U8, pack

INT8_MODES = ("int8", "w8a8")


def channel_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` -> (int8 codes ``[N, K]``, float16 scales ``[N]``): each row's codes
    ``round(w / s)`` with ``s = fp16(max|w| / 127)`` (0 rows: scale 0)."""
    w = weight.detach().to(torch.float32)
    scale = (w.abs().amax(dim=1) / 127).to(torch.float16)
    s = scale.to(torch.float32)
    codes = torch.where(s[:, None] > 0, torch.round(w / torch.where(s > 0, s, 1)[:, None]), 0)
    return codes.clamp(-127, 127).to(torch.int8), scale


def u8_blocks(weight: torch.Tensor) -> np.ndarray:
    """``weight [N, K]`` (K a multiple of 32) -> U8 blocks ``uint8 [N, K / 32 * 36]``: per block
    fp16 d, fp16 m, then 32 codes ``u = round((w - m) / d)`` in [0, 255] (see the module
    docstring; m rounded down and d up to fp16, so every weight lies within half a step of its
    code's value); ValueError for a weight fp16 cannot scale."""
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"int8 weights need in_features divisible by {BLOCK}, got {k}")
    w = weight.detach().to(torch.float32).reshape(n, k // BLOCK, BLOCK).numpy()  # [N, blocks, 32]
    if not np.isfinite(w).all() or np.abs(w).max() > np.finfo(np.float16).max:
        raise ValueError("int8 weights keep fp16 scales: every weight must be finite and within "
                         f"+-{np.finfo(np.float16).max:g}")
    low, high = w.min(axis=-1, keepdims=True), w.max(axis=-1, keepdims=True)
    m = low.astype(np.float16)  # [N, blocks, 1], rounded down: no weight below d * 0 + m
    m = np.where(m.astype(np.float32) > low, np.nextafter(m, np.float16(-np.inf)), m)
    span = high - m.astype(np.float32)
    d = (span / 255).astype(np.float16)  # rounded up: no weight above d * 255 + m
    d = np.where(255 * d.astype(np.float32) < span, np.nextafter(d, np.float16(np.inf)), d)
    step = d.astype(np.float32)
    codes = np.rint((w - m.astype(np.float32)) / np.where(step > 0, step, 1))
    raw = np.empty((n, k // BLOCK, 36), dtype=np.uint8)
    raw[..., 0:2] = d.view(np.uint8)
    raw[..., 2:4] = m.view(np.uint8)
    raw[..., 4:] = np.where(step > 0, codes.clip(0, 255), 0)
    return raw.reshape(n, -1)


def u8_dequantize(raw: np.ndarray, in_features: int) -> torch.Tensor:
    """U8 blocks ``uint8 [N, K / 32 * 36]`` -> the float32 weight ``[N, K]`` they hold."""
    b = raw.reshape(raw.shape[0], in_features // BLOCK, 36)
    d = torch.from_numpy(b[..., 0:2].copy().view(np.float16)).float()  # [N, blocks, 1]
    m = torch.from_numpy(b[..., 2:4].copy().view(np.float16)).float()
    return (d * torch.from_numpy(b[..., 4:].copy()).float() + m).reshape(raw.shape[0], -1)


def int8_tensor(weight: torch.Tensor) -> QuantTensor:
    """``weight [N, K]`` in U8 blocks (:func:`u8_blocks`) as a :class:`QuantTensor`."""
    n, k = weight.shape
    return QuantTensor(pack(u8_blocks(weight), U8, k), U8, n, k, origin="int8")


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
