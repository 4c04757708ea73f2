"""The layout of a scaled KV row, shared by the kernels that write and read one and by the KV
spec that sizes it: ``head_dim`` one-byte values (int8 on the CPU, fp8 on CUDA), then a float16
scale for that token and KV head."""

from __future__ import annotations

import torch

#: bytes of the float16 scale after each head's one-byte values
SCALE_BYTES = 2
#: fp8 caches (CUDA: the Triton twins read them, the Triton write quantizes into them)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
