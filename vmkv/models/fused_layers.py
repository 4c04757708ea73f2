"""The CPU decoder stack as C calls around the attention backend (what a float32 CPU model runs).

    x = embed(ids)                                        [T, hidden], updated in place below
    for each layer:
        attn_in(x)          -> qkv [T, (Hq+2Hkv)*D]       norm, qkv GEMM, RoPE    (one C call)
        attention(q, k, v)  -> attn [T, Hq*D]             the step's backend, either KV mode
        attn_out(x, attn)                                 o GEMM, residual, norm, gate_up GEMM,
                                                          SiLU*up, down GEMM, residual (one C call)
    return norm(x)

It replaces :meth:`LlamaModel.body <vmkv.models.llama.LlamaModel.body>` (``model.run_body``)
when every layer can take it: float32 on the CPU, the four linears packed for MKL, no per-head
q/k norm, one tensor-parallel rank, and the kernel library built (:func:`fuse_layers` says why
not otherwise). Measured against the TorchInductor-compiled layers it replaces: at small decode
batches those spent ~0.4 ms per layer in framework time around ~0.8 ms of GEMMs
(docs/benchmarks.md). The attention stays the opaque :func:`vmkv.attention.op.attention` call,
so both KV modes keep their kernels.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from vmkv.attention.op import attention
from vmkv.kernels import cpu_decoder_layer as kernels
from vmkv.models.linear import PackedLinear, mkl_compute_address
from vmkv.models.llama import LlamaDecoderLayer, LlamaModel

logger = logging.getLogger(__name__)


class FusedLayers:
    """``model``'s decoder layers as :mod:`vmkv.kernels.cpu_decoder_layer` calls; build with
    :func:`fuse_layers`. The model's parameters stay its own (the calls read them in place)."""

    def __init__(self, model: LlamaModel) -> None:
        cfg = model.config
        self.model = model
        self.lib = kernels.library()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.hidden, self.intermediate, self.scale = (
            cfg.hidden_size, cfg.intermediate_size, cfg.scale)
        self.qkv_width = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        #: GEMM and elementwise ns, added to while :meth:`profile` is on
        self.ns = torch.zeros(2, dtype=torch.int64)
        self.shape = kernels.LayerShape(
            hidden=cfg.hidden_size, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim, intermediate=cfg.intermediate_size, eps=cfg.rms_norm_eps,
            gemm=mkl_compute_address(), ns=None)
        self.layers = [ctypes.pointer(_layer_args(layer)) for layer in model.layers]
        #: 2 * (the layers' linear weights): a token's GEMM FLOPs through the stack
        self.flops_per_token = 2 * sum(
            lin.in_features * lin.out_features for layer in model.layers
            for lin in _linears(layer))

    def profile(self, on: bool) -> None:
        """Count the calls' GEMM and elementwise time in :attr:`ns` (on) or not (off)."""
        self.shape.ns = self.ns.data_ptr() if on else None

    def body(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """:meth:`LlamaModel.body`: ``input_ids, positions [T]`` -> final-norm hidden
        ``[T, hidden]``, attention through the step the model's ``forward`` set."""
        model = self.model
        x = model.embed_tokens(input_ids)  # [T, hidden], a new tensor: the calls update it
        cos, sin = model.rotary(positions, x.dtype)  # [T, D] each, contiguous
        t = x.shape[0]
        h = x.new_empty(t, self.hidden)  # scratch: normed input, GEMM outputs
        qkv = x.new_empty(t, self.qkv_width)  # reused by every layer (attention copies K/V)
        gu = x.new_empty(t, 2 * self.intermediate)  # gate | up, then SiLU(gate)*up | up
        hq, hkv = self.num_heads, self.num_kv_heads
        heads = qkv.view(t, hq + 2 * hkv, self.head_dim)
        q, k, v = heads[:, :hq], heads[:, hq : hq + hkv], heads[:, hq + hkv :]  # [T, H, D]
        shape = ctypes.byref(self.shape)
        x_ptr, h_ptr, gu_ptr = x.data_ptr(), h.data_ptr(), gu.data_ptr()
        cos_ptr, sin_ptr, qkv_ptr = cos.data_ptr(), sin.data_ptr(), qkv.data_ptr()
        for layer in self.layers:
            if self.lib.vmkv_layer_attn_in(shape, layer, x_ptr, t, cos_ptr, sin_ptr, h_ptr,
                                           qkv_ptr):
                raise ValueError(f"bad shapes for the fused decoder layer (T={t})")
            out = attention(q, k, v, self.scale)  # [T, Hq * D]
            if out.stride(-1) != 1:
                out = out.contiguous()
            if self.lib.vmkv_layer_attn_out(shape, layer, x_ptr, t, out.data_ptr(),
                                            out.stride(0), h_ptr, gu_ptr):
                raise ValueError(f"bad shapes for the fused decoder layer (T={t})")
        return model.norm(x)


def _linears(layer: LlamaDecoderLayer) -> tuple[torch.nn.Module, ...]:
    return (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
            layer.mlp.down_proj)


def _linear_args(lin: PackedLinear) -> kernels.PackedLinearArgs:
    return kernels.PackedLinearArgs(
        packed=lin.packed_weight.data_ptr(),
        bias=lin.bias.data_ptr() if lin.bias is not None else None,
        in_features=lin.in_features, out_features=lin.out_features)


def _layer_args(layer: LlamaDecoderLayer) -> kernels.DecoderLayerArgs:
    qkv, o, gate_up, down = (_linear_args(lin) for lin in _linears(layer))  # type: ignore[arg-type]
    return kernels.DecoderLayerArgs(
        qkv=qkv, o=o, gate_up=gate_up, down=down,
        input_norm=layer.input_layernorm.weight.data_ptr(),
        post_norm=layer.post_attention_layernorm.weight.data_ptr())


def unfusable(model: LlamaModel) -> str | None:
    """Why ``model``'s layers cannot run fused (None if they can)."""
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return f"{model.dtype} on {model.device.type} (fused layers are float32 CPU only)"
    for layer in model.layers:
        if any(not (isinstance(lin, PackedLinear) and lin.backend == "mkl")
               for lin in _linears(layer)):
            return "the linears are not packed for MKL (linear_backend)"
        if layer.self_attn.q_norm is not None:
            return "per-head q/k norms"
        if layer.self_attn.reduce or layer.reduce_mlp:
            return "tensor-parallel shards"
        tensors = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                   *(lin.bias for lin in _linears(layer) if lin.bias is not None)]
        if any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
            return "norm weights or biases that are not contiguous float32"
    if model.config.head_dim % 2:
        return "an odd head_dim"
    if not kernels.available():
        return "the kernel library did not build (see the log)"
    return None


def fuse_layers(model: LlamaModel) -> FusedLayers | None:
    """Make ``model`` run its decoder layers fused (``model.run_body``); None, with a log
    line saying why, when it cannot."""
    reason = unfusable(model)
    if reason is not None:
        logger.info("fused CPU decoder layers off: %s", reason)
        return None
    fused = FusedLayers(model)
    model.run_body = fused.body
    return fused
