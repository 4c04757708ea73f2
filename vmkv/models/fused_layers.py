"""The CPU decoder stack as C calls around the attention backend (what a CPU model runs).

    x = embed(ids)                                        [T, hidden], updated in place below
    for each layer:
        attn_in(x)          -> qkv [T, (Hq+2Hkv)*D]       norm, qkv GEMM, RoPE    (one C call)
        attention(q, k, v)  -> attn [T, Hq*D]             the step's backend, either KV mode
        attn_out(x, attn)                                 o GEMM, residual, norm, gate_up GEMM,
                                                          SiLU*up, down GEMM, residual (one C call)
    return norm(x)

Two libraries with the same two calls per layer, chosen by the linears' backend:

    float32, mkl        csrc/cpu_decoder_layer.cpp   MKL's packed sgemm
    bfloat16, brgemm    csrc/cpu_bf16_layer.cpp      oneDNN's brgemm ukernel on AMX or
                                                     AVX512-BF16, rounding to bf16 where
                                                     transformers does
    float32, brgemm     csrc/cpu_bf16_layer.cpp      the same body in float32 (AVX-512)
    either, quant       csrc/cpu_quant_layer.cpp     GGUF block formats (QuantLinear): integer
                                                     dot products on the file's blocks

It replaces :meth:`LlamaModel.body <vmkv.models.llama.LlamaModel.body>` (``model.run_body``)
when every layer can take it: the four linears packed for that library, no per-head q/k norm,
one tensor-parallel rank, and the library built (:func:`fuse_layers` says why not otherwise).
Gemma 3's layers (sandwich and per-head q/k norms, tanh-GELU, a RoPE table per layer type) run in
the brgemm library (:class:`~vmkv.kernels.cpu_bf16.GemmaNormArgs`); its other libraries take
Llama's layers only.
Measured against the TorchInductor-compiled layers it replaces: at small decode batches those
spent ~0.4 ms per layer in framework time around ~0.8 ms of GEMMs (docs/benchmarks.md). The
attention stays the opaque :func:`vmkv.attention.op.attention` call, so both KV modes keep
their kernels.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import torch

from vmkv.attention.op import attention
from vmkv.kernels import cpu_bf16, cpu_quant
from vmkv.kernels import cpu_decoder_layer as f32_kernels
from vmkv.models.gemma3 import Gemma3DecoderLayer, Gemma3Model
from vmkv.models.linear import PackedLinear, mkl_compute_address
from vmkv.models.llama import LlamaDecoderLayer, LlamaModel
from vmkv.models.quant.decode_loop import DecodeLoop
from vmkv.models.quant.modules import QuantLinear

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Library:
    """One layer library: the dtype and linear backend its weights need, and its calls."""

    dtype: torch.dtype
    backend: str  # PackedLinear.backend the calls read ("quant": QuantLinear)
    act_width: int  # scratch columns per intermediate column: gate|up (2) or SiLU*up (1)

    def lib(self) -> ctypes.CDLL:
        if self.backend == "quant":
            return cpu_quant.library()
        return f32_kernels.library() if self.backend == "mkl" else cpu_bf16.library(self.dtype)

    def unavailable(self) -> str | None:
        if self.backend in ("mkl", "quant"):
            built = (f32_kernels if self.backend == "mkl" else cpu_quant).available()
            return None if built else "the kernel library did not build"
        return cpu_bf16.unavailable_reason(self.dtype)

    def takes(self, linear: torch.nn.Module) -> bool:
        """Whether ``linear`` is packed for this library."""
        if self.backend == "quant":
            return isinstance(linear, QuantLinear)
        return isinstance(linear, PackedLinear) and linear.backend == self.backend


_LIBRARIES = {(torch.float32, "mkl"): _Library(torch.float32, "mkl", 2),
              (torch.float32, "brgemm"): _Library(torch.float32, "brgemm", 1),
              (torch.bfloat16, "brgemm"): _Library(torch.bfloat16, "brgemm", 1),
              (torch.float32, "quant"): _Library(torch.float32, "quant", 1),
              (torch.bfloat16, "quant"): _Library(torch.bfloat16, "quant", 1)}


def _library_of(model: LlamaModel) -> _Library | None:
    """The library for ``model``'s dtype and its first layer's qkv backend (None: none)."""
    qkv = model.layers[0].self_attn.qkv_proj if model.layers else None
    backend = ("quant" if isinstance(qkv, QuantLinear)
               else qkv.backend if isinstance(qkv, PackedLinear) else None)
    return _LIBRARIES.get((model.dtype, backend))


class FusedLayers:
    """``model``'s decoder layers as C calls; build with :func:`fuse_layers`. The model's
    parameters and packed weights stay its own (the calls read them in place)."""

    def __init__(self, model: LlamaModel) -> None:
        cfg = model.config
        self.model = model
        library = _library_of(model)
        assert library is not None, "fuse_layers checks unfusable() first"
        self.library = library
        self.lib = self.library.lib()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.hidden, self.intermediate, self.scale = (
            cfg.hidden_size, cfg.intermediate_size, cfg.scale)
        self.qkv_width = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        #: GEMM, elementwise and (the quantized decode loop's) attention ns, added to while
        #: :meth:`profile` is on
        self.ns = torch.zeros(3 if library.backend == "quant" else 2, dtype=torch.int64)
        if library.backend == "mkl":
            self.shape: ctypes.Structure = f32_kernels.LayerShape(
                hidden=cfg.hidden_size, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim, intermediate=cfg.intermediate_size, eps=cfg.rms_norm_eps,
                gemm=mkl_compute_address(), ns=None)
            self.attn_in, self.attn_out = self.lib.vmkv_layer_attn_in, self.lib.vmkv_layer_attn_out
        elif library.backend == "quant":
            self.shape = cpu_quant.ShapeArgs(
                hidden=cfg.hidden_size, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim, intermediate=cfg.intermediate_size, eps=cfg.rms_norm_eps,
                ns=None)
            self.attn_in, self.attn_out = (cpu_quant.entry(model.dtype, name)
                                           for name in ("attn_in", "attn_out"))
        else:
            self.shape = cpu_bf16.ShapeArgs(
                hidden=cfg.hidden_size, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim, intermediate=cfg.intermediate_size, eps=cfg.rms_norm_eps,
                gemm=cpu_bf16.gemm_args(dtype=model.dtype))
            self.attn_in, self.attn_out = (cpu_bf16.entry(self.lib, model.dtype, name)
                                           for name in ("attn_in", "attn_out"))
        #: Gemma 3's norm scales per layer (kept alive: the layer structures point at them)
        self._gemma_norms = [_gemma_norm_args(layer) for layer in model.layers
                             if isinstance(layer, Gemma3DecoderLayer)]
        self.layers = [ctypes.pointer(_layer_args(layer, library.backend))
                       for layer in model.layers]
        for args, norms in zip(self.layers, self._gemma_norms, strict=False):
            args.contents.gemma = ctypes.pointer(norms)
        #: which RoPE table each layer reads: 0 the model's, 1 the local one (Gemma's sliding
        #: layers)
        self.rope_of = ([int(s) for s in model.sliding] if isinstance(model, Gemma3Model)
                        else [0] * len(model.layers))
        #: pure-decode steps' whole stack in one C call (quantized weights)
        self.decode_loop = (DecodeLoop(self.shape, [p.contents for p in self.layers],
                                       model.dtype, cfg.scale)
                            if library.backend == "quant" else None)
        #: 2 * (the layers' linear weights): a token's GEMM FLOPs through the stack
        self.flops_per_token = 2 * sum(
            lin.in_features * lin.out_features for layer in model.layers
            for lin in _linears(layer))
        last = model.layers[-1].self_attn.qkv_proj if model.layers else None
        #: what a row the last layer drops (``keep``) skips: all but its qkv GEMM
        self._dropped_flops = (self.flops_per_token // max(1, len(self.layers))
                               - (2 * last.in_features * last.out_features if last else 0))

    def step_flops(self, num_tokens: int, kept: int | None = None) -> int:
        """The GEMM FLOPs of a :meth:`body` call of ``num_tokens`` rows, ``kept`` of them
        through the last layer's output projection and MLP (None: all)."""
        dropped = 0 if kept is None else num_tokens - kept
        return self.flops_per_token * num_tokens - self._dropped_flops * dropped

    def profile(self, on: bool) -> None:
        """Count the calls' GEMM and elementwise time in :attr:`ns` (on) or not (off)."""
        address = self.ns.data_ptr() if on else None
        if isinstance(self.shape, cpu_bf16.ShapeArgs):
            self.shape.gemm.ns = address
        else:  # the float32 MKL library's and the quantized one's
            self.shape.ns = address

    def body(self, input_ids: torch.Tensor, positions: torch.Tensor,
             keep: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`LlamaModel.body`: ``input_ids, positions [T]`` -> final-norm hidden
        ``[T, hidden]`` (``[N, hidden]`` of the rows ``keep [N]``), attention through the step
        the model's ``forward`` set."""
        model = self.model
        x = model.embed_tokens(input_ids)  # [T, hidden], a new tensor: the calls update it
        ropes = [model.rotary(positions, x.dtype)]  # (cos, sin) [T, D] each, contiguous
        if isinstance(model, Gemma3Model):
            x = x * model.embed_scale
            ropes.append(model.local_rotary(positions, x.dtype))
        cos, sin = ropes[0]
        t = x.shape[0]
        h = x.new_empty(t, self.hidden)  # scratch: normed input, GEMM outputs
        qkv = x.new_empty(t, self.qkv_width)  # reused by every layer (attention copies K/V)
        act = x.new_empty(t, self.library.act_width * self.intermediate)  # MLP activations
        hq, hkv = self.num_heads, self.num_kv_heads
        heads = qkv.view(t, hq + 2 * hkv, self.head_dim)
        q, k, v = heads[:, :hq], heads[:, hq : hq + hkv], heads[:, hq + hkv :]  # [T, H, D]
        step = self.decode_loop.takes(keep) if self.decode_loop is not None else None
        if step is not None:  # every request decodes: all layers in one call
            self.decode_loop.run(x, cos, sin, *step, [h, qkv, act])
            return model.norm(x)
        shape = ctypes.byref(self.shape)
        x_ptr, h_ptr, act_ptr = x.data_ptr(), h.data_ptr(), act.data_ptr()
        rope_ptrs = [(c.data_ptr(), s.data_ptr()) for c, s in ropes]
        qkv_ptr = qkv.data_ptr()
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            cos_ptr, sin_ptr = rope_ptrs[self.rope_of[i]]
            _check(self.attn_in(shape, layer, x_ptr, t, cos_ptr, sin_ptr, h_ptr, qkv_ptr), t)
            out = attention(q, k, v, self.scale)  # [T, Hq * D]
            rows = t
            if keep is not None and i == last:  # every row's K/V is written: keep what is wanted
                out, x = out.index_select(0, keep), x.index_select(0, keep)  # [N, ...]
                rows, x_ptr = x.shape[0], x.data_ptr()
            if out.stride(-1) != 1:
                out = out.contiguous()
            _check(self.attn_out(shape, layer, x_ptr, rows, out.data_ptr(), out.stride(0), h_ptr,
                                 act_ptr), rows)
        return model.norm(x)


def _check(err: int, t: int) -> None:
    if err == 1:
        raise ValueError(f"bad shapes for the fused decoder layer (T={t})")
    if err:
        raise RuntimeError(f"the fused decoder layer's matrix kernel failed (T={t})")


def _linears(layer: LlamaDecoderLayer) -> tuple[torch.nn.Module, ...]:
    return (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
            layer.mlp.down_proj)


def _f32_linear_args(lin: PackedLinear) -> f32_kernels.PackedLinearArgs:
    return f32_kernels.PackedLinearArgs(
        packed=lin.packed_weight.data_ptr(),
        bias=lin.bias.data_ptr() if lin.bias is not None else None,
        in_features=lin.in_features, out_features=lin.out_features)


def _gemma_norm_args(layer: Gemma3DecoderLayer) -> cpu_bf16.GemmaNormArgs:
    return cpu_bf16.GemmaNormArgs(*(scale.data_ptr() for scale in _norm_tensors(layer)))


def _norm_tensors(layer: LlamaDecoderLayer | Gemma3DecoderLayer) -> list[torch.Tensor]:
    """The norm tensors the C calls read: Llama's two weights, or Gemma's six float32 scales
    (in :class:`~vmkv.kernels.cpu_bf16.GemmaNormArgs`' order)."""
    if isinstance(layer, Gemma3DecoderLayer):
        attn = layer.self_attn
        return [norm.scale for norm in (layer.input_layernorm, layer.post_attention_layernorm,
                                        layer.pre_feedforward_layernorm,
                                        layer.post_feedforward_layernorm, attn.q_norm,
                                        attn.k_norm)]
    return [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]


def _layer_args(layer: LlamaDecoderLayer, backend: str) -> ctypes.Structure:
    if backend == "mkl":
        structure, linear_args = f32_kernels.DecoderLayerArgs, _f32_linear_args
    elif backend == "quant":
        structure, linear_args = cpu_quant.LayerArgs, QuantLinear.args
    else:
        structure, linear_args = cpu_bf16.LayerArgs, PackedLinear.brgemm_args
    qkv, o, gate_up, down = (linear_args(lin) for lin in _linears(layer))  # type: ignore[arg-type]
    if isinstance(layer, Gemma3DecoderLayer):  # FusedLayers points `gemma` at its norms
        return structure(qkv=qkv, o=o, gate_up=gate_up, down=down)
    return structure(qkv=qkv, o=o, gate_up=gate_up, down=down,
                     input_norm=layer.input_layernorm.weight.data_ptr(),
                     post_norm=layer.post_attention_layernorm.weight.data_ptr())


def unfusable(model: LlamaModel) -> str | None:
    """Why ``model``'s layers cannot run fused (None if they can)."""
    if model.device.type != "cpu" or model.dtype not in (torch.float32, torch.bfloat16):
        return f"{model.dtype} on {model.device.type} (fused layers are float32/bfloat16 CPU)"
    library = _library_of(model)
    if library is None:
        return "the linears are not packed for mkl or brgemm (linear_backend)"
    gemma = isinstance(model, Gemma3Model)
    if gemma and library.backend != "brgemm":
        return f"Gemma 3 layers fuse in the brgemm library only (linears: {library.backend})"
    for layer in model.layers:
        if not all(library.takes(lin) for lin in _linears(layer)):
            return f"the linears are not packed for {library.backend} (linear_backend)"
        if layer.self_attn.q_norm is not None and not gemma:
            return "per-head q/k norms"
        if layer.self_attn.reduce or layer.reduce_mlp:
            return "tensor-parallel shards"
        norms = _norm_tensors(layer)
        biases = [lin.bias for lin in _linears(layer) if lin.bias is not None]
        if any(t.dtype != (torch.float32 if gemma else model.dtype) or not t.is_contiguous()
               for t in norms) or any(t.dtype != model.dtype or not t.is_contiguous()
                                      for t in biases):
            return f"norm weights or biases that are not contiguous {model.dtype}"
        if (library.backend == "brgemm" and model.config.intermediate_size
                % cpu_bf16.block_width(layer.mlp.gate_up_proj.packed_weight)):
            return "an intermediate size that is not a whole number of packed column blocks"
    if model.config.head_dim % 2:
        return "an odd head_dim"
    reason = library.unavailable()
    if reason is not None:
        return f"{reason} (see the log)"
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
