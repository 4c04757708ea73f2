"""Gemma 3 (text): the second model family, over the same attention op, KV modes and loader.

    x = embed(ids) * sqrt(hidden)                                     [T, hidden]
    per layer (sliding-window or full attention, ``cfg.layer_windows``):
        x = x + post_attn_norm(attn(input_norm(x)))       q/k (1 + w) RMSNorm per head, RoPE
                                                           (local base on sliding layers, global
                                                           on full ones), scale
                                                           query_pre_attn_scalar ** -0.5
        x = x + post_ffw_norm(down(gelu_tanh(gate(h)) * up(h)))     h = pre_ffw_norm(x)
    hidden = norm(x); logits = hidden @ embed^T (tied)

Every norm is ``normalize(x) * (1 + w)`` in float32, then cast (transformers' Gemma3RMSNorm);
``1 + w`` is folded once at load. The sliding window is not the model's business: the KV
spec's layer groups (:meth:`ModelConfig.kv_spec`) carry each layer's window, and the attention
backends apply it (every kernel reads only the window's rows). Weights load through
:mod:`vmkv.models.loader` (same fused names: ``qkv_proj``, ``gate_up_proj``; the extra norms
keep transformers' names).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vmkv.distributed.collectives import all_reduce
from vmkv.models.config import ModelConfig
from vmkv.models.layers import GatedMLP, RotaryEmbedding
from vmkv.models.llama import Device, LlamaAttention, LlamaModel


class GemmaRMSNorm(nn.Module):
    """``normalize(x) * (1 + weight)`` in float32, cast back to ``x``'s dtype; ``weight`` is
    the checkpoint's, ``scale`` (``1 + weight`` in float32) is set by :meth:`fold`."""

    def __init__(self, dim: int, eps: float, *, device: Device = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype),
                                   requires_grad=False)
        self.register_buffer("scale", torch.empty(dim, device=device), persistent=False)

    def fold(self) -> None:
        """``scale = 1 + weight`` (float32), once the weight is loaded."""
        self.scale = 1.0 + self.weight.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., dim]
        out = F.rms_norm(x.float(), self.scale.shape, self.scale, self.eps)
        return out.to(x.dtype)


class GeGLU(GatedMLP):
    """``down(gelu_tanh(gate(x)) * up(x))``, gate and up fused as in :class:`GatedMLP`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> gate_up: [T, 2 * intermediate]
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)  # [T, hidden]


class Gemma3Attention(LlamaAttention):
    """Llama's attention (fused QKV, per-head q/k norms, RoPE, the attention op) with Gemma's
    (1 + w) norms and ``query_pre_attn_scalar`` scale (``cfg.scale``)."""

    def __init__(self, cfg: ModelConfig, *, device: Device, dtype: torch.dtype) -> None:
        super().__init__(cfg, device=device, dtype=dtype)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, device=device, dtype=dtype)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, device=device, dtype=dtype)


class Gemma3DecoderLayer(nn.Module):
    """Norms before and after both the attention and the MLP ("sandwich" norms)."""

    def __init__(self, cfg: ModelConfig, *, device: Device, dtype: torch.dtype) -> None:
        super().__init__()

        def norm() -> GemmaRMSNorm:
            return GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device, dtype=dtype)

        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = Gemma3Attention(cfg, device=device, dtype=dtype)
        self.mlp = GeGLU(cfg.hidden_size, cfg.intermediate_size, bias=False, device=device,
                         dtype=dtype)
        self.reduce_mlp = cfg.tensor_parallel_size > 1  # a shard: down sums over the ranks

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]`` (``[N, hidden]`` of the rows ``keep [N]``, as
        :meth:`vmkv.models.llama.LlamaDecoderLayer.forward`)."""
        attn = self.self_attn(self.input_layernorm(x), cos, sin, keep)  # [T or N, hidden]
        x = (x if keep is None else x.index_select(0, keep)) + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(x))  # [T or N, hidden]
        if self.reduce_mlp:
            mlp = all_reduce(mlp)
        return x + self.post_feedforward_layernorm(mlp)


class Gemma3Model(LlamaModel):
    """Gemma 3's decoder stack and tied head behind :class:`LlamaModel`'s interface
    (``forward``, ``body``, ``compute_logits``, ``load_weights``; built on ``device="meta"``
    by the loader)."""

    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype = torch.float32,
                 device: Device = "cpu", rope_device: Device = None) -> None:
        nn.Module.__init__(self)
        self.config = cfg
        self.dtype = dtype
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(
            cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype))
        #: sqrt(hidden) rounded to the model's dtype, as transformers multiplies
        self.embed_scale = float(torch.tensor(cfg.hidden_size**0.5).to(dtype))
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, device=device, dtype=dtype)
                                    for _ in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device, dtype=dtype)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=device,
                                 dtype=dtype)
        rope_device = rope_device if rope_device is not None else device
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, device=rope_device)
        self.local_rotary = RotaryEmbedding(cfg.local_rope or cfg.rope, cfg.head_dim,
                                            device=rope_device)
        #: whether layer i is a sliding-window layer (its RoPE is the local one)
        self.sliding = [bool(w) for w in cfg.layer_windows] or [False] * cfg.num_layers
        self.requires_grad_(False)
        self.run_body = None

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """As :meth:`LlamaModel.load_weights`, then ``1 + w`` of every norm folded."""
        super().load_weights(state)
        for module in self.modules():
            if isinstance(module, GemmaRMSNorm):
                module.fold()

    def body(self, input_ids: torch.Tensor, positions: torch.Tensor,
             keep: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`LlamaModel.body` for Gemma 3: ``input_ids, positions [T]`` -> final-norm
        hidden ``[T, hidden]`` (``[N, hidden]`` of the rows ``keep``)."""
        x = self.embed_tokens(input_ids) * self.embed_scale  # [T, hidden]
        ropes = (self.rotary(positions, x.dtype),  # full layers' (cos, sin) [T, head_dim]
                 self.local_rotary(positions, x.dtype))  # sliding layers'
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            cos, sin = ropes[self.sliding[i]]
            if keep is None or i < last:
                x = layer(x, cos, sin)
            else:  # the class's own forward: a compiled layer's graph takes no keep
                x = Gemma3DecoderLayer.forward(layer, x, cos, sin, keep)  # [N, hidden]
        return self.norm(x)
