"""GGUF's block formats rearranged for the quantized kernels (``csrc/cpu_quant_gemm.h``): the
same bytes, in groups of 16 output rows.

    GGUF, per row and block of 32 inputs        packed, per group of 16 rows and block of 32
    Q4_0  d | qs[16]               (18 bytes)   codes[256] | d[16]                  (288 = 16 x 18)
    Q4_1  d | m | qs[16]           (20 bytes)   codes[256] | d[16] | m[16]          (320 = 16 x 20)
    Q5_0  d | qh[4] | qs[16]       (22 bytes)   codes[256] | hbits[64] | d[16]      (352 = 16 x 22)
    Q8_0  d | qs[32]               (34 bytes)   codes[512] | d[16]                  (544 = 16 x 34)
    U8    d | m | us[32]           (36 bytes)   codes[512] | d[16] | m[16]          (576 = 16 x 36)

U8 is vmkv's own block, no GGUF type (``--quantization int8``): 32 unsigned codes with an fp16
scale and minimum, value ``d * u + m`` (Q4_1's scheme at 8 bits; :mod:`vmkv.models.quant.int8`).

A 4-bit format's codes are four 64-byte loads; byte ``4r + e`` of load ``j`` is row ``r``'s GGUF
byte ``4j + e`` of the block (its low nibble element ``4j + e``, its high nibble element
``16 + 4j + e``: GGUF's own pairing). Q8_0's are eight loads, byte ``4r + e`` of load ``j`` row
``r``'s element ``4j + e`` plus 128 (U8's: the code itself). Q5_0's fifth bits are eight
64-bit masks, mask ``g`` bit ``4r + e`` = row ``r``'s element ``4g + e``. A weight whose rows are
not a multiple of 16 gets zero rows (scale 0) up to the next one. Packing is numpy transposes
of whole bytes; unpacking (:func:`unpack`, for tests) is its inverse.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP, BLOCK = 16, 32
U8 = 100  # vmkv's asymmetric 8-bit block's type id (csrc/cpu_quant_gemm.h's kU8)


@dataclass(frozen=True)
class BlockFormat:
    """One GGUF block format: its GGML type id and how a block's bytes split."""

    name: str
    ggml_type: int
    block_bytes: int  # GGUF bytes per row and block of 32
    zero: int  # the code of 0.0 (symmetric formats), 0 for Q4_1 and U8 (a minimum per block)
    gguf: bool = True  # a GGUF type (U8 is vmkv's own)

    @property
    def minimum(self) -> bool:
        """Whether a block holds a minimum beside its scale (``d u + m``: Q4_1, U8)."""
        return self.zero == 0

    @property
    def record_bytes(self) -> int:
        """Packed bytes per group of 16 rows and block of 32 (16 blocks' worth)."""
        return GROUP * self.block_bytes


#: the formats the kernels take, by GGML type id (gguf.GGMLQuantizationType)
FORMATS = {f.ggml_type: f for f in (BlockFormat("Q4_0", 2, 18, 8), BlockFormat("Q4_1", 3, 20, 0),
                                    BlockFormat("Q5_0", 6, 22, 16),
                                    BlockFormat("Q8_0", 8, 34, 128),
                                    BlockFormat("U8", U8, 36, 0, gguf=False))}


def _by_group(a: np.ndarray, groups: int, blocks: int, *inner: int) -> np.ndarray:
    """``a [rows, blocks, n]`` -> ``[groups, blocks, *inner over (16 rows), ...]`` views: row r
    of group g, then ``inner`` splits n; the 16 rows move inside the block after inner[0]."""
    a = a.reshape(groups, GROUP, blocks, *inner)
    order = (0, 2, 3, 1, *range(4, 3 + len(inner))) if len(inner) > 1 else (0, 2, 1, 3)
    return a.transpose(order)


def pack(raw: np.ndarray, ggml_type: int, in_features: int) -> torch.Tensor:
    """``raw [rows, in_features / 32 * block_bytes]`` (uint8, a GGUF tensor's bytes) packed into
    groups of 16 rows: ``uint8 [ceil(rows / 16) * in_features / 32 * record_bytes]``."""
    fmt = FORMATS[ggml_type]
    rows, blocks = raw.shape[0], in_features // BLOCK
    if in_features % BLOCK or raw.shape[1] != blocks * fmt.block_bytes:
        raise ValueError(f"a {fmt.name} tensor of {in_features} inputs has "
                         f"{blocks * fmt.block_bytes} bytes per row, got {raw.shape[1]}")
    groups = -(-rows // GROUP)
    b = np.zeros((groups * GROUP, blocks, fmt.block_bytes), dtype=np.uint8)
    b[:rows] = raw.reshape(rows, blocks, fmt.block_bytes)
    d = _by_group(b[..., 0:2], groups, blocks, 2).reshape(groups, blocks, 32)
    parts = []
    if fmt.name == "Q8_0":
        codes = _by_group(b[..., 2:] ^ 0x80, groups, blocks, 8, 4)  # + 128: unsigned
        parts.append(codes.reshape(groups, blocks, 512))
    elif fmt.name == "U8":
        parts.append(_by_group(b[..., 4:], groups, blocks, 8, 4).reshape(groups, blocks, 512))
    else:
        qs = b[..., fmt.block_bytes - 16 :]
        parts.append(_by_group(qs, groups, blocks, 4, 4).reshape(groups, blocks, 256))
    if fmt.name == "Q5_0":
        bits = np.unpackbits(b[..., 2:6], axis=-1, bitorder="little")  # [rows, blocks, 32]
        masks = _by_group(bits, groups, blocks, 8, 4).reshape(groups, blocks, 8, 64)
        parts.append(np.packbits(masks, axis=-1, bitorder="little").reshape(groups, blocks, 64))
    parts.append(d)
    if fmt.minimum:
        parts.append(_by_group(b[..., 2:4], groups, blocks, 2).reshape(groups, blocks, 32))
    packed = np.concatenate(parts, axis=-1)
    assert packed.shape[-1] == fmt.record_bytes
    return torch.from_numpy(np.ascontiguousarray(packed).reshape(-1))


def _from_group(a: np.ndarray, rows: int, blocks: int, *inner: int) -> np.ndarray:
    """The inverse of :func:`_by_group`: ``[groups, blocks, ...]`` -> ``[rows, blocks, n]``."""
    groups = a.shape[0]
    if len(inner) > 1:
        a = a.reshape(groups, blocks, inner[0], GROUP, *inner[1:]).transpose(0, 3, 1, 2, 4)
    else:
        a = a.reshape(groups, blocks, GROUP, inner[0]).transpose(0, 2, 1, 3)
    return a.reshape(groups * GROUP, blocks, -1)[:rows]


def unpack(packed: torch.Tensor, ggml_type: int, rows: int, in_features: int) -> np.ndarray:
    """The GGUF bytes ``[rows, in_features / 32 * block_bytes]`` a :func:`pack` result holds."""
    fmt = FORMATS[ggml_type]
    blocks, groups = in_features // BLOCK, -(-rows // GROUP)
    rec = packed.numpy().reshape(groups, blocks, fmt.record_bytes)
    codes = 512 if fmt.name in ("Q8_0", "U8") else 256
    hbits = 64 if fmt.name == "Q5_0" else 0
    d = _from_group(rec[..., codes + hbits : codes + hbits + 32], rows, blocks, 2)
    out = [d]
    if fmt.minimum:
        out.append(_from_group(rec[..., codes + 32 :], rows, blocks, 2))
    if fmt.name == "Q5_0":
        masks = np.unpackbits(rec[..., codes : codes + 64].reshape(groups, blocks, 8, 8),
                              axis=-1, bitorder="little")
        bits = _from_group(masks.reshape(groups, blocks, 8 * 64), rows, blocks, 8, 4)
        out.append(np.packbits(bits, axis=-1, bitorder="little"))
    if fmt.name == "Q8_0":
        out.append(_from_group(rec[..., :codes], rows, blocks, 8, 4) ^ 0x80)
    elif fmt.name == "U8":
        out.append(_from_group(rec[..., :codes], rows, blocks, 8, 4))
    else:
        out.append(_from_group(rec[..., :codes], rows, blocks, 4, 4))
    return np.concatenate(out, axis=-1).reshape(rows, blocks * fmt.block_bytes)
