"""Building blocks of the Llama family: RMSNorm, rotary embedding, SiLU-gated MLP.

The arithmetic follows transformers operation for operation (RMSNorm in float32 then cast;
RoPE frequencies in float32 from float32 positions, cos/sin cast to the activation dtype), so
fp32 results match HF up to matmul accumulation order.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vmkv.models.config import RopeConfig


class RMSNorm(nn.Module):
    """``weight * normalize(x)`` over the last dim; statistics in float32."""

    def __init__(self, dim: int, eps: float, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., dim]
        if x.dtype == torch.float32:  # one fused op; the same arithmetic as below in float32
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        xf = x.to(torch.float32)
        variance = xf.pow(2).mean(-1, keepdim=True)
        xf = xf * torch.rsqrt(variance + self.eps)
        return self.weight * xf.to(dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """``[head_dim // 2]`` float32 inverse frequencies, llama3 scaling applied if configured."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "default":
        return inv_freq
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between
    factor, low, high = rope.factor, rope.low_freq_factor, rope.high_freq_factor
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / low
    high_freq_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for absolute positions, computed per step (no length limit, no cache)."""

    def __init__(self, rope: RopeConfig, head_dim: int, *,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(rope, head_dim).to(device),
                             persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] -> cos, signed sin: [T, head_dim] in `dtype`, computed once per step
        # (no size-1 dimension: a compiled layer then sees T as its only dynamic size)
        freqs = positions[:, None].to(torch.float32) * self.inv_freq  # [T, head_dim/2] fp32
        cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
        return torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, head_dim]`` (neox half-split) by ``cos, signed_sin [T, D]``.

    ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)`` is written as
    ``x * cos + cat(x2, x1) * cat(-sin, sin)``: the same products (a sign moved), one roll.
    """
    return x * cos[:, None] + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin[:, None]


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one ``gate_up_proj``."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias,
                                      device=device, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias,
                                   device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> gate_up: [T, 2 * intermediate]
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)  # [T, hidden]
