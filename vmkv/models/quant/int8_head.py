"""The int8 LM head (``--lm-head-dtype int8``): a step's logits from u8 x s8 products, each
row's leading candidates rescored from the dense head.

    logits  x quantized per row (token) to int8, the head per row (vocabulary entry): every
            logit within ~0.1-1 % of the dense head's (kernel: vmkv.kernels.cpu_int8_head)
    rescore each row's CANDIDATES largest int8 logits recomputed from the dense weight in the
            model's dtype (float32 accumulation) and written over their int8 values

So a greedy row picks the dense head's token whenever that token ranks among its row's
CANDIDATES largest int8 logits; random sampling draws from logits whose head is exact and whose
tail carries the int8 rounding. Measured on Gemma 3 270M (bf16, 2,560 positions of
docs/ARCHITECTURE.md and docs/models.md): int8 logits alone agree on the top-1 token with the
dense head at 94.4 %; rescored, see docs/models.md ("The int8 LM head").

The dense weight is kept for rescoring: for tied embeddings it is the embedding table the model
keeps anyway; an untied head keeps its dense copy (its int8 copy adds a quarter of bf16's bytes).
"""

from __future__ import annotations

import torch
from torch import nn

from vmkv.kernels import cpu_int8_head

#: the rows each logits row rescores exactly
CANDIDATES = 16
LM_HEAD_DTYPES = ("auto", "int8")


class Int8Head(nn.Module):
    """``logits [m, N] = x [m, K] W^T`` (float32) from int8 products, rescored (module doc)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        reason = cpu_int8_head.unavailable_reason()
        if reason is not None:
            raise ValueError(f"--lm-head-dtype int8 cannot run here: {reason}")
        if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"--lm-head-dtype int8 takes a float32 or bfloat16 CPU head, got "
                             f"{weight.dtype} on {weight.device.type}")
        packed = cpu_int8_head.pack(weight)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.dense = weight.detach()  # [N, K], shared with a tied embedding
        self.register_buffer("packed", packed.packed, persistent=False)
        self.register_buffer("comp", packed.comp, persistent=False)
        self.register_buffer("scale", packed.scale, persistent=False)
        self._args = cpu_int8_head.head_args(packed, self.dense)

    @property
    def nbytes(self) -> int:
        """Bytes of the int8 copy (codes, corrections, scales)."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.comp, self.scale))

    @torch.compiler.disable
    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        # x: [m, K] -> [m, N] float32 (into ``out`` when given)
        x = x.contiguous()
        if out is None:
            out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        return cpu_int8_head.head(x, self._args, out, CANDIDATES)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"candidates={CANDIDATES}")


def quantize_head(model: nn.Module) -> Int8Head:
    """Swap ``model.lm_head`` (a dense ``nn.Linear`` without bias) for an :class:`Int8Head`;
    ValueError where the head is not one (a GGUF file's own Q8_0 head, a biased head)."""
    head = model.lm_head
    if not isinstance(head, nn.Linear) or head.bias is not None:
        raise ValueError(f"--lm-head-dtype int8 quantizes a dense LM head without bias; this "
                         f"model's is {type(head).__name__} (a GGUF file's head served in its own "
                         f"format is already quantized: use --quantization none)")
    model.lm_head = Int8Head(head.weight)
    return model.lm_head
