"""Row picks over float32 CPU logits (``csrc/cpu_argmax.cpp``): greedy sampling's argmax and
random sampling's inverse-CDF draw.

torch's CPU ``argmax`` reduces with an index in tow, one element at a time: 2.3 ms for 64 rows of
a 49,152-token vocabulary on a 2-core AVX-512 machine, against 0.4 ms here (two vectorised
passes per row). The answer is torch's: the first maximum, or the first NaN of a row that has
one. Anything the kernel does not take (not a CPU float32 matrix with unit column stride) goes to
``torch.argmax``, and so does everything when the library cannot be built (one warning says
why).

``sample_rows`` draws ``softmax(logits / T)`` with one uniform per row (inverse CDF), where
torch's CPU ``exponential_`` noise for the exponential race costs ~1 ms a row of 49,152 entries
(60 ms a step at batch 64) and ~5 ms a row of 262,144. Without the library (or for a tensor it
does not take) the same draw runs in torch: a float64 running sum and ``searchsorted``.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from vmkv.kernels.build import CPU_FLAGS, CSRC, load_cpu_library

SOURCE = CSRC / "cpu_argmax.cpp"
LIBRARY = "vmkv_cpu_argmax"
#: what runs without the library
FALLBACK = "torch.argmax instead"


@functools.cache
def _lib() -> ctypes.CDLL | None:
    lib = load_cpu_library(SOURCE, CPU_FLAGS, LIBRARY, FALLBACK)
    if lib is None:
        return None
    lib.vmkv_cpu_argmax.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                    ctypes.c_int64, ctypes.c_void_p]
    lib.vmkv_cpu_argmax.restype = ctypes.c_int
    lib.vmkv_cpu_sample.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                    ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                    ctypes.c_void_p]
    lib.vmkv_cpu_sample.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the library builds and loads here (builds it on the first call)."""
    return _lib() is not None


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits [B, V]`` -> int64 ``[B]``, equal to ``logits.argmax(dim=-1)``."""
    lib = _lib() if _takes(logits) else None
    if lib is None:
        return logits.argmax(dim=-1)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    if lib.vmkv_cpu_argmax(logits.data_ptr(), logits.shape[0], logits.shape[1],
                           logits.stride(0), out.data_ptr()):
        raise ValueError(f"bad arguments to the CPU argmax kernel: {tuple(logits.shape)}, "
                         f"strides {logits.stride()}")
    return out


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor,
                uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of ``logits [B, V]`` from ``softmax(logits / temperature)``: the first
    index whose running probability exceeds ``uniforms`` (float64 ``[B]`` in [0, 1)).

    ``temperature``: float32 ``[B]``, each > 0. Tokens at -inf are never drawn; a row of -inf
    returns 0 and a row holding a NaN its first NaN (as :func:`argmax_rows`). Returns int64 ``[B]``.
    """
    if temperature.shape != (logits.shape[0],) or uniforms.shape != (logits.shape[0],):
        raise ValueError(f"temperature {tuple(temperature.shape)} and uniforms "
                         f"{tuple(uniforms.shape)} must be [{logits.shape[0]}] for logits "
                         f"{tuple(logits.shape)}")
    lib = _lib() if _takes(logits) else None
    if lib is None:
        return _sample_rows_torch(logits, temperature, uniforms)
    inv_t = temperature.to(torch.float32).reciprocal().contiguous()
    uniforms = uniforms.to(torch.float64).contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    if lib.vmkv_cpu_sample(logits.data_ptr(), logits.shape[0], logits.shape[1],
                           logits.stride(0), inv_t.data_ptr(), uniforms.data_ptr(),
                           out.data_ptr()):
        raise ValueError(f"bad arguments to the CPU sampling kernel: logits "
                         f"{tuple(logits.shape)}, strides {logits.stride()}, temperatures "
                         f"{temperature.tolist()} (each > 0), uniforms in [0, 1)")
    return out


def _sample_rows_torch(logits: torch.Tensor, temperature: torch.Tensor,
                       uniforms: torch.Tensor) -> torch.Tensor:
    """:func:`sample_rows` in torch (any device)."""
    probs = (logits.float() / temperature.to(logits.device, torch.float32)[:, None]).softmax(-1)
    cdf = probs.cumsum(-1, dtype=torch.float64)  # cdf: [B, V]
    target = uniforms.to(cdf.device, torch.float64)[:, None] * cdf[:, -1:]  # target: [B, 1]
    picks = torch.searchsorted(cdf, target, right=True).squeeze(1)  # picks: [B]
    # a draw rounding past the end takes the row's last token with any probability
    last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(-1)
    picks = torch.minimum(picks, last)
    bad_rows = ~cdf[:, -1].isfinite()  # a NaN in the row, or every token at -inf
    if bool(bad_rows.any()):  # the first NaN, else 0
        picks = torch.where(bad_rows, logits.isnan().int().argmax(-1), picks)
    return picks


def _takes(logits: torch.Tensor) -> bool:
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.shape[1] > 0 and logits.stride(1) == 1
            and logits.stride(0) >= logits.shape[1])
