"""SmoothQuant for ``--quantization w8a8``: move the activations' outlier channels into the
weights before both are rounded to int8 (Xiao et al., 2023).

A per-token int8 activation has one scale per row, set by its largest channel; a few channels
of a decoder's linear inputs run tens of times larger than the rest, so the rest round to a
handful of levels. For each linear, input channel ``j`` is divided by

    s_j = max|x_j| ** alpha / max|W[:, j]| ** (1 - alpha)            (alpha = ALPHA)

and the weight's column ``j`` multiplied by it: the product is unchanged, the outliers are
shared between the two operands. ``max|x_j|`` is measured once at load on a short shipped text
(``calibration.txt``, ~1,200 tokens of prose, dialogue, code, figures), and every division is
folded into the operation that produces the input, so serving costs nothing:

    q|k|v, gate|up   into the RMSNorm before them (its weight / s)
    o                into v's rows (a KV head's channel feeds every query head of its group:
                     one factor per KV-head channel, from the group's largest)
    down             into up's rows (silu(gate) * up is linear in up)

Llama-family layers on one rank only (the folds follow their structure; a tensor-parallel
shard cannot run the calibration pass alone); other models are quantized without it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from vmkv.attention.op import attention_step
from vmkv.attention.sdpa import attend_one
from vmkv.models.llama import LlamaDecoderLayer

logger = logging.getLogger(__name__)

#: the migration strength: 0.5 measured best of 0.35 / 0.5 / 0.65 / 0.8 on the default model
#: (docs/models.md, "Quantized weights")
ALPHA = 0.5
CALIBRATION_TEXT = Path(__file__).with_name("calibration.txt")
#: tokens per calibration forward (one causal sequence each)
CHUNK = 512

Stats = dict[tuple[int, str], torch.Tensor]  # (layer, linear name) -> [in_features] max |x|


class _WholeSequenceAttention:
    """Causal attention of one sequence over itself, no cache: the calibration pass."""

    name = "calibration"

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: object, scale: float) -> torch.Tensor:
        return attend_one(q, k, v, 0, scale)  # [T, Hq * D]


def calibration_ids(model_path: Path, vocab_size: int) -> list[int]:
    """The calibration text in the model folder's tokenizer; a folder without one (a bare
    checkpoint) gets a fixed pseudo-random token sequence of the same length."""
    from transformers import AutoTokenizer

    text = CALIBRATION_TEXT.read_text()
    try:
        return list(AutoTokenizer.from_pretrained(model_path)(text)["input_ids"])
    except (OSError, ValueError):
        logger.warning("w8a8: %s has no tokenizer; calibrating on random tokens", model_path)
        generator = torch.Generator().manual_seed(0)
        return torch.randint(vocab_size, (1200,), generator=generator).tolist()


@torch.no_grad()
def input_maxima(model: nn.Module, ids: list[int]) -> Stats:
    """Per decoder linear, each input channel's largest magnitude over ``ids``."""
    stats: Stats = {}

    def record(key: tuple[int, str]):  # noqa: ANN202
        def hook(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            amax = args[0].detach().float().abs().amax(dim=0)  # [in_features]
            stats[key] = torch.maximum(stats[key], amax) if key in stats else amax
        return hook

    hooks = [linear.register_forward_pre_hook(record((i, name)))
             for i, layer in enumerate(model.layers)
             for name, linear in layer.named_modules() if isinstance(linear, nn.Linear)]
    chunk = min(CHUNK, model.config.max_model_len)
    try:
        for start in range(0, len(ids), chunk):
            piece = torch.tensor(ids[start : start + chunk], dtype=torch.int64)
            with attention_step(_WholeSequenceAttention(), None):  # type: ignore[arg-type]
                model.body(piece, torch.arange(len(piece)))
    finally:
        for hook in hooks:
            hook.remove()
    return stats


def factors(x_max: torch.Tensor, w_max: torch.Tensor, alpha: float = ALPHA) -> torch.Tensor:
    """``s = x_max ** alpha / w_max ** (1 - alpha)`` per channel (float32, kept positive)."""
    tiny = 1e-5
    return (x_max.clamp(min=tiny) ** alpha / w_max.clamp(min=tiny) ** (1 - alpha)).clamp(min=tiny)


def _scale(tensor: torch.Tensor, by: torch.Tensor) -> None:
    """``tensor *= by`` (broadcast) computed in float32, stored in the tensor's dtype."""
    tensor.copy_((tensor.float() * by).to(tensor.dtype))


@torch.no_grad()
def smooth_layer(layer: nn.Module, stats: Stats, index: int, alpha: float = ALPHA) -> None:
    """Fold one Llama decoder layer's smoothing factors (see the module docstring)."""
    attn, mlp = layer.self_attn, layer.mlp
    for norm, linear, name in ((layer.input_layernorm, attn.qkv_proj, "self_attn.qkv_proj"),
                               (layer.post_attention_layernorm, mlp.gate_up_proj,
                                "mlp.gate_up_proj")):
        s = factors(stats[(index, name)], linear.weight.float().abs().amax(dim=0),
                    alpha)  # [hidden]
        _scale(norm.weight, 1 / s)
        _scale(linear.weight, s)  # [N, hidden] columns
    inter = mlp.down_proj.in_features
    s = factors(stats[(index, "mlp.down_proj")], mlp.down_proj.weight.float().abs().amax(dim=0),
                alpha)
    _scale(mlp.gate_up_proj.weight[inter:], 1 / s[:, None])  # up's rows
    if mlp.gate_up_proj.bias is not None:
        _scale(mlp.gate_up_proj.bias[inter:], 1 / s)
    _scale(mlp.down_proj.weight, s)
    heads, kv_heads, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    group = heads // kv_heads
    x_max = stats[(index, "self_attn.o_proj")].view(kv_heads, group, d).amax(dim=1)
    w_max = attn.o_proj.weight.float().abs().amax(dim=0).view(kv_heads, group, d).amax(dim=1)
    s = factors(x_max, w_max, alpha)  # [kv_heads, D]
    v_rows = slice((heads + kv_heads) * d, (heads + 2 * kv_heads) * d)
    _scale(attn.qkv_proj.weight[v_rows], 1 / s.reshape(-1, 1))
    if attn.qkv_proj.bias is not None:
        _scale(attn.qkv_proj.bias[v_rows], 1 / s.reshape(-1))
    _scale(attn.o_proj.weight, s[:, None, :].expand(kv_heads, group, d).reshape(-1))


def smooth_for_w8a8(model: nn.Module, model_path: Path) -> bool:
    """Calibrate ``model`` (its linears still dense) and fold the factors into its weights;
    False (nothing changed) where the folds do not apply (see the module docstring)."""
    if model.config.tensor_parallel_size > 1 or not all(
            type(layer) is LlamaDecoderLayer for layer in model.layers):
        logger.info("w8a8: activations not smoothed (Llama-family layers on one rank only)")
        return False
    stats = input_maxima(model, calibration_ids(model_path, model.config.vocab_size))
    for index, layer in enumerate(model.layers):
        smooth_layer(layer, stats, index)
    return True
