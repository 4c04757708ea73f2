"""A GGUF file's weights served as the file holds them (``--quantization gguf``, and ``auto`` for
a GGUF model): each linear stays in its block format (:mod:`vmkv.models.quant.modules`), the
norms (F32 in the file) are cast to the engine's dtype, and a tied embedding table serves both
the token lookup and the LM head in its own format (Q8_0 in SmolLM2's file), logits in float32.

    GGUF name                          vmkv module
    token_embd.weight                  embed_tokens (and lm_head when there is no output.weight)
    output.weight / output_norm.weight lm_head / norm
    blk.N.attn_q|attn_k|attn_v         layers.N.self_attn.qkv_proj   (three segments, + biases)
    blk.N.attn_output                  layers.N.self_attn.o_proj
    blk.N.ffn_gate|ffn_up              layers.N.mlp.gate_up_proj     (two segments)
    blk.N.ffn_down                     layers.N.mlp.down_proj
    blk.N.attn_norm / ffn_norm         input_layernorm / post_attention_layernorm
    blk.N.attn_q_norm / attn_k_norm    self_attn.q_norm / k_norm     (Qwen3)

llama.cpp's converter permutes the rows of a Llama model's q and k projections (its RoPE pairs
neighbouring dimensions); transformers reverses that when it dequantizes, and so does this
module, by moving whole quantized rows. A linear in a format the kernels do not take (F16,
K-quants, ...) is dequantized into an ``nn.Linear`` in the engine's dtype (the rest stay
quantized). The model config comes from transformers' reading of the same file (the converted
folder), so only the tensors are read here, with the ``gguf`` package (memory-mapped).
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch import nn

from vmkv.kernels import cpu_quant
from vmkv.models.config import ModelConfig
from vmkv.models.llama import LlamaModel
from vmkv.models.quant.modules import QuantEmbedding, QuantLinear, QuantTensor
from vmkv.models.quant.packing import FORMATS, GROUP

logger = logging.getLogger(__name__)

#: GGUF ``general.architecture`` values served natively, and vmkv's architectures they load as
ARCHITECTURES = {"llama": ("LlamaForCausalLM", "MistralForCausalLM"),
                 "qwen2": ("Qwen2ForCausalLM",), "qwen3": ("Qwen3ForCausalLM",)}
_PERMUTED = ("llama",)  # q/k rows permuted by llama.cpp's converter


def _reverse_permutation(rows: int, heads: int) -> np.ndarray:
    """The row order transformers' ``_reverse_permute_weights`` gives ``rows`` rows of ``heads``
    heads: new row i is file row ``perm[i]``."""
    dim = rows // heads // 2
    return np.arange(rows).reshape(heads, dim, 2).swapaxes(2, 1).reshape(rows)


class GGUFWeights:
    """The tensors of one GGUF file, by name (memory-mapped until :meth:`close`)."""

    def __init__(self, path: str | Path) -> None:
        import gguf

        self.path = Path(path)
        try:
            self.reader = gguf.GGUFReader(self.path)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read GGUF file {str(self.path)!r}: {e}") from e
        self.tensors = {t.name: t for t in self.reader.tensors}
        field = self.reader.fields.get("general.architecture")
        self.architecture = (bytes(field.parts[field.data[0]]).decode() if field is not None
                             else "unknown")

    @property
    def tensor_bytes(self) -> int:
        """The bytes of every tensor in the file (what a native load should hold)."""
        return sum(int(t.n_bytes) for t in self.tensors.values())

    def has(self, name: str) -> bool:
        return name in self.tensors

    def _tensor(self, name: str):  # noqa: ANN202 (gguf's ReaderTensor)
        if name not in self.tensors:
            raise ValueError(f"{self.path.name} has no tensor {name!r}")
        return self.tensors[name]

    def native(self, name: str) -> bool:
        """Whether ``name`` is in a block format the quantized kernels take."""
        fmt = FORMATS.get(int(self._tensor(name).tensor_type))
        return fmt is not None and fmt.gguf

    def quantized(self, name: str, rows: np.ndarray | None = None) -> QuantTensor:
        """``name`` packed in its block format (``rows``: the file rows to take, in order)."""
        t = self._tensor(name)
        raw = np.asarray(t.data)
        return QuantTensor.from_gguf(raw if rows is None else raw[rows], int(t.tensor_type),
                                     int(t.shape[0]))

    def dense(self, name: str, dtype: torch.dtype, rows: np.ndarray | None = None
              ) -> torch.Tensor:
        """``name`` dequantized (``[rows, in]`` for a matrix, ``[n]`` for a vector) in ``dtype``."""
        import gguf

        t = self._tensor(name)
        values = gguf.dequantize(np.asarray(t.data), t.tensor_type)
        values = values.reshape(-1, int(t.shape[0])) if len(t.shape) > 1 else values.reshape(-1)
        if rows is not None:
            values = values[rows]
        return torch.from_numpy(np.array(values, dtype=np.float32)).to(dtype)  # a writable copy

    def close(self) -> None:
        """Drop the file's mapping (packed tensors are copies)."""
        self.tensors.clear()
        del self.reader


def native_unavailable(weights: GGUFWeights, cfg: ModelConfig) -> str | None:
    """Why ``weights`` cannot be served natively (None when it can)."""
    archs = ARCHITECTURES.get(weights.architecture)
    if archs is None or cfg.architecture not in archs:
        return (f"{weights.architecture} ({cfg.architecture}) is not served natively (the Llama "
                f"family: {', '.join(ARCHITECTURES)})")
    if not cpu_quant.available():
        return "the quantized-weight kernel library did not build (see the log)"
    if cfg.hidden_size % 32 or cfg.intermediate_size % GROUP:
        return "a hidden size that is not a multiple of 32 (or an intermediate size of 16)"
    return None


def _linear(weights: GGUFWeights, names: list[str], dtype: torch.dtype,
            rows: list[np.ndarray | None], bias: list[str] | None = None,
            out_dtype: torch.dtype | None = None) -> nn.Module:
    """One linear from the GGUF tensors ``names`` (their rows stacked in order): a
    :class:`QuantLinear` when every part is in a native format, else a dequantized
    ``nn.Linear``."""
    bias_t = (torch.cat([weights.dense(b, dtype, r) for b, r in zip(bias, rows, strict=True)])
              if bias and all(weights.has(b) for b in bias) else None)
    parts = [weights.quantized(n, r) if weights.native(n) else None
             for n, r in zip(names, rows, strict=True)]
    if all(p is not None for p in parts) and all(p.rows % GROUP == 0 for p in parts[:-1]):
        return QuantLinear(parts, bias_t, out_dtype)  # type: ignore[arg-type]
    logger.info("%s: %s dequantized to %s (not a format the quantized kernels take)",
                weights.path.name, "|".join(names), dtype)
    w = torch.cat([weights.dense(n, dtype, r) for n, r in zip(names, rows, strict=True)])
    linear = nn.Linear(w.shape[1], w.shape[0], bias=bias_t is not None, device="meta", dtype=dtype)
    linear.weight = nn.Parameter(w, requires_grad=False)
    if bias_t is not None:
        linear.bias = nn.Parameter(bias_t, requires_grad=False)
    return linear


def _norm_weight(module: nn.Module, weights: GGUFWeights, name: str, dtype: torch.dtype) -> None:
    module.weight = nn.Parameter(weights.dense(name, dtype), requires_grad=False)


def load_gguf_model(weights: GGUFWeights, cfg: ModelConfig, dtype: torch.dtype) -> LlamaModel:
    """``cfg``'s model (the whole model, one rank, CPU) on ``weights``' own block formats."""
    reason = native_unavailable(weights, cfg)
    if reason is not None:
        raise ValueError(f"cannot serve {weights.path.name} natively: {reason}")
    model = LlamaModel(cfg, dtype=dtype, device="meta", rope_device="cpu")
    permute = weights.architecture in _PERMUTED
    q_rows = _reverse_permutation(cfg.q_size, cfg.num_heads) if permute else None
    k_rows = _reverse_permutation(cfg.kv_size, cfg.num_kv_heads) if permute else None
    for i, layer in enumerate(model.layers):
        p = f"blk.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = _linear(weights, [p + "attn_q.weight", p + "attn_k.weight",
                                          p + "attn_v.weight"], dtype, [q_rows, k_rows, None],
                                bias=[p + "attn_q.bias", p + "attn_k.bias", p + "attn_v.bias"])
        attn.o_proj = _linear(weights, [p + "attn_output.weight"], dtype, [None],
                              bias=[p + "attn_output.bias"])
        mlp.gate_up_proj = _linear(weights, [p + "ffn_gate.weight", p + "ffn_up.weight"], dtype,
                                   [None, None])
        mlp.down_proj = _linear(weights, [p + "ffn_down.weight"], dtype, [None])
        _norm_weight(layer.input_layernorm, weights, p + "attn_norm.weight", dtype)
        _norm_weight(layer.post_attention_layernorm, weights, p + "ffn_norm.weight", dtype)
        if attn.q_norm is not None and attn.k_norm is not None:
            _norm_weight(attn.q_norm, weights, p + "attn_q_norm.weight", dtype)
            _norm_weight(attn.k_norm, weights, p + "attn_k_norm.weight", dtype)
    _norm_weight(model.norm, weights, "output_norm.weight", dtype)
    head = "output.weight" if weights.has("output.weight") else "token_embd.weight"
    model.lm_head = _linear(weights, [head], dtype, [None], out_dtype=torch.float32)
    if weights.native("token_embd.weight"):
        table = (model.lm_head.segments[0] if head == "token_embd.weight"
                 and isinstance(model.lm_head, QuantLinear)
                 else weights.quantized("token_embd.weight"))
        model.embed_tokens = QuantEmbedding(table, dtype)
    else:
        model.embed_tokens = nn.Embedding.from_pretrained(
            weights.dense("token_embd.weight", dtype), freeze=True)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"{weights.path.name} does not fit {cfg.architecture}: no weights for "
                         f"{left[:5]}")
    return model.eval()


def describe_weights(model: nn.Module) -> str:
    """The weights' formats and resident bytes, for the start-up report and benches: e.g.
    ``weights: 210 Q4_1 + 1 Q8_0 tensors in their GGUF blocks, the rest and activations
    bfloat16, 96.6 MB resident``."""
    from vmkv.models.quant.int8 import W8A8Linear

    formats: Counter[str] = Counter()
    for module in model.modules():
        if isinstance(module, QuantLinear):
            formats.update(module.formats)
        elif isinstance(module, W8A8Linear):
            formats["w8a8"] += 1
    dtype = str(getattr(model, "dtype", "")).removeprefix("torch.")
    held = f"{weight_bytes(model) / 1e6:,.1f} MB resident"
    if not formats:
        return f"weights: {dtype}, {held}"
    kinds = " + ".join(f"{n} {f}" for f, n in sorted(formats.items()))
    where = ("in their GGUF blocks" if not {"int8", "w8a8"} & set(formats)
             else "per block of 32" if "int8" in formats else "per output channel")
    return f"weights: {kinds} tensors {where}, the rest and activations {dtype}, {held}"


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage counted once (a oneDNN-packed
    weight, which has no storage to share, at its elements' bytes)."""
    seen: dict[int, int] = {}
    opaque = 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type == "meta" or not t.numel():
            continue
        if t.is_mkldnn:
            opaque += t.numel() * t.element_size()
        else:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values()) + opaque
