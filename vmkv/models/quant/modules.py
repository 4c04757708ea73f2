"""Modules on quantized weights kept in their GGUF blocks (:mod:`vmkv.kernels.cpu_quant`).

    QuantLinear     y = x W^T + b; W one to three :class:`QuantTensor` segments of rows (q|k|v of
                    a fused projection may each have their own format)
    QuantEmbedding  the rows of a one-segment table (a tied embedding serves both)

Inference only, CPU only, float32 or bfloat16 activations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vmkv.kernels import cpu_quant
from vmkv.models.quant.packing import FORMATS, GROUP, pack


@dataclass(frozen=True)
class QuantTensor:
    """A weight ``[rows, in_features]`` in one GGUF block format, packed by
    :func:`~vmkv.models.quant.packing.pack` (``packed``: uint8, the file's bytes)."""

    packed: torch.Tensor
    ggml_type: int
    rows: int
    in_features: int
    origin: str = "gguf"  # "gguf": a file's tensor; "int8": quantized at load (U8 blocks)

    @classmethod
    def from_gguf(cls, raw, ggml_type: int, in_features: int) -> QuantTensor:
        """From a GGUF tensor's bytes ``raw [rows, bytes per row]`` (a numpy uint8 array)."""
        return cls(pack(raw, ggml_type, in_features), ggml_type, raw.shape[0], in_features)

    @property
    def format(self) -> str:
        return FORMATS[self.ggml_type].name

    @property
    def nbytes(self) -> int:
        return self.packed.numel()


class QuantLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` the rows of ``segments`` in order (every segment but the last
    a multiple of 16 rows). ``out_dtype``: float32 (the LM head) or None (x's dtype)."""

    def __init__(self, segments: list[QuantTensor], bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if not segments or len({s.in_features for s in segments}) != 1:
            raise ValueError("a quantized linear needs segments of one in_features")
        if any(s.rows % GROUP for s in segments[:-1]):
            raise ValueError(f"every segment but the last needs a multiple of {GROUP} rows")
        self.segments = segments
        self.in_features = segments[0].in_features
        self.out_features = sum(s.rows for s in segments)
        self.out_dtype = out_dtype
        for i, s in enumerate(segments):
            self.register_buffer(f"packed_{i}", s.packed, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self._args: cpu_quant.LinearArgs | None = None

    def args(self) -> cpu_quant.LinearArgs:
        """The C view of the weight (built once the buffers are final)."""
        if self._args is None:
            packed = [getattr(self, f"packed_{i}") for i in range(len(self.segments))]
            self._args = cpu_quant.linear_args(
                [(p, s.rows, s.ggml_type) for p, s in zip(packed, self.segments, strict=True)],
                self.bias, self.in_features)
        return self._args

    @property
    def formats(self) -> tuple[str, ...]:
        """Each segment's format (``int8`` for weights quantized at load)."""
        return tuple(s.format if s.origin == "gguf" else s.origin for s in self.segments)

    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in_features] -> [T, out_features]
        return cpu_quant.linear(x, self.args(), self.out_dtype or x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"formats={'|'.join(self.formats)}")


class QuantEmbedding(nn.Module):
    """Token embeddings looked up in a quantized table ``[vocab, hidden]`` (a tied LM head's
    :class:`QuantLinear` shares its tensor)."""

    def __init__(self, table: QuantTensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.table = table
        self.dtype = dtype
        self.register_buffer("packed", table.packed, persistent=False)
        self._args: cpu_quant.LinearArgs | None = None

    @torch.compiler.disable
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, hidden]
        if self._args is None:
            self._args = cpu_quant.linear_args(
                [(self.packed, self.table.rows, self.table.ggml_type)], None,
                self.table.in_features)
        return cpu_quant.embed(input_ids, self._args, self.dtype)
