"""One forward for the whole Llama family (Llama, SmolLM2, Mistral, Qwen2, Qwen3).

A step is a flat batch of tokens from several requests (prefill chunks and decodes mixed):

    input_ids [T], positions [T]  ->  embed -> L x (attn + MLP) -> norm  ->  hidden [T, hidden]

The model keeps no KV: every layer hands its new q/k/v to the step's :class:`AttentionBackend`
(through :func:`vmkv.attention.op.attention`, an opaque operator to ``torch.compile``), which
writes K/V into the cache manager's memory and attends. Weights use vmkv names (fused
``qkv_proj`` and ``gate_up_proj``); :mod:`vmkv.models.loader` maps HF checkpoints onto them.

:meth:`LlamaModel.body` is the forward over tensors only (what a compiler sees);
:meth:`LlamaModel.forward` sets the step's attention around it and runs it, compiled when
:func:`vmkv.models.compile.compile_model` replaced it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from vmkv.attention.base import AttentionBackend, AttentionMetadata
from vmkv.attention.op import attention, attention_step
from vmkv.distributed.collectives import all_reduce
from vmkv.models.config import ModelConfig
from vmkv.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rope
from vmkv.models.linear import writes_float32_into

Device = torch.device | str | None


class LlamaAttention(nn.Module):
    """Fused QKV projection, optional per-head q/k RMSNorm, RoPE, backend attention, output."""

    def __init__(self, cfg: ModelConfig, *, device: Device, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.sizes = [cfg.q_size, cfg.kv_size, cfg.kv_size]
        self.scale = cfg.scale
        self.reduce = cfg.tensor_parallel_size > 1  # a shard: O sums over the ranks
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(self.sizes), bias=cfg.qkv_bias,
                                  device=device, dtype=dtype)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias,
                                device=device, dtype=dtype)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, device=device, dtype=dtype)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, hidden]; cos, sin: [T, head_dim]; keep: [N] rows the output is wanted for
        t, hq = x.shape[0], self.num_heads
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) * D]
        heads = qkv.view(t, hq + 2 * self.num_kv_heads, self.head_dim)
        v = heads[:, hq + self.num_kv_heads :]  # [T, Hkv, D]
        if self.q_norm is not None and self.k_norm is not None:
            q = apply_rope(self.q_norm(heads[:, :hq]), cos, sin)  # [T, Hq, D]
            k = apply_rope(self.k_norm(heads[:, hq : hq + self.num_kv_heads]), cos, sin)
        else:  # q and k heads are adjacent: rotate them in one go
            qk = apply_rope(heads[:, : hq + self.num_kv_heads], cos, sin)  # [T, Hq + Hkv, D]
            q, k = qk[:, :hq], qk[:, hq:]
        out = attention(q, k, v, self.scale)  # [T, Hq * D], this layer's (the step counts)
        if keep is not None:  # every row's K/V is written; only kept rows go on
            out = out.index_select(0, keep)  # [N, Hq * D]
        out = self.o_proj(out)  # [T or N, hidden]
        return all_reduce(out) if self.reduce else out


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: ModelConfig, *, device: Device, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device,
                                       dtype=dtype)
        self.self_attn = LlamaAttention(cfg, device=device, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                device=device, dtype=dtype)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias,
                            device=device, dtype=dtype)
        self.reduce_mlp = cfg.tensor_parallel_size > 1  # a shard: down sums over the ranks

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``, or ``[N, hidden]`` for the rows ``keep [N]``
        (int64): the attention still writes every row's K/V, the output projection and the MLP
        run on the kept rows only."""
        attn = self.self_attn(self.input_layernorm(x), cos, sin, keep)  # [T or N, hidden]
        x = (x if keep is None else x.index_select(0, keep)) + attn
        mlp = self.mlp(self.post_attention_layernorm(x))  # [T or N, hidden]
        return x + (all_reduce(mlp) if self.reduce_mlp else mlp)


class LlamaModel(nn.Module):
    """Decoder stack plus LM head. Build with ``device="meta"`` and :meth:`load_weights` to
    load without allocating twice; the rotary table is always built on ``rope_device``."""

    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype = torch.float32,
                 device: Device = "cpu", rope_device: Device = None) -> None:
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        # NOTE: an explicit weight skips normal_() init, which on meta imports torch._dynamo
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(
            cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype))
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, device=device, dtype=dtype)
                                    for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device, dtype=dtype)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=device,
                                 dtype=dtype)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim,
                                      device=rope_device if rope_device is not None else device)
        self.requires_grad_(False)
        #: what :meth:`forward` runs instead of :meth:`body` (fused layers), None for body
        self.run_body: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device  # (a quantized embedding keeps no float weight)

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Adopt ``state`` (vmkv names, final dtype and device) as the parameters, no copies.

        With tied embeddings ``lm_head.weight`` may be absent; the head then shares
        ``embed_tokens.weight``. Raises ValueError on missing, unexpected or misshapen weights.
        """
        state = dict(state)
        if self.config.tie_word_embeddings:
            state["lm_head.weight"] = state.get("embed_tokens.weight")  # type: ignore[assignment]
        expected = {name: p.shape for name, p in self.named_parameters(remove_duplicate=False)}
        missing = sorted(n for n in expected if state.get(n) is None)
        unexpected = sorted(set(state) - set(expected))
        if missing or unexpected:
            raise ValueError(f"checkpoint does not fit {self.config.architecture}: "
                             f"missing {missing[:5]}, unexpected {unexpected[:5]}")
        for name, shape in expected.items():
            if state[name].shape != shape:
                raise ValueError(f"weight {name} has shape {tuple(state[name].shape)}, "
                                 f"expected {tuple(shape)}")
        self.load_state_dict(state, strict=True, assign=True)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                meta: AttentionMetadata, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step; returns final-norm hidden states ``[T, hidden]``, or ``[N, hidden]``
        of the rows ``keep [N]`` (sorted int64 row numbers; the last layer's output projection
        and MLP then run on those rows only: a prefill chunk needs its K/V from the last layer,
        its hidden states only where logits are wanted).

        ``input_ids``, ``positions``: ``[T]`` int64 on the model's device, flattened in
        ``meta``'s request order; the KV manager must already hold room for every token.
        """
        with attention_step(attn, meta):
            return (self.run_body or self.body)(input_ids, positions, keep)

    def body(self, input_ids: torch.Tensor, positions: torch.Tensor,
             keep: torch.Tensor | None = None) -> torch.Tensor:
        """The forward over tensors only (``input_ids, positions [T]`` -> ``[T, hidden]``, or
        ``[N, hidden]`` with ``keep``); attention goes to the step set by :meth:`forward`."""
        x = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary(positions, x.dtype)  # [T, head_dim] each
        *layers, last = self.layers
        for layer in layers:
            x = layer(x, cos, sin)
        if keep is None:
            x = last(x, cos, sin)
        else:  # the class's own forward: a compiled layer's graph takes no keep
            x = LlamaDecoderLayer.forward(last, x, cos, sin, keep)  # [N, hidden]
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None
                       ) -> torch.Tensor:
        """``hidden [N, hidden]`` -> float32 logits ``[N, vocab]`` (head in the model dtype),
        in ``out`` (float32 ``[N, vocab]``) where the head writes float32 itself
        (:func:`~vmkv.models.linear.writes_float32_into`); otherwise ``out`` is not used."""
        if out is not None and writes_float32_into(self.lm_head):
            return self.lm_head(hidden, out=out)
        return self.lm_head(hidden).to(torch.float32)
