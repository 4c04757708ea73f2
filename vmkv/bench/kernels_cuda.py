"""The CUDA half of ``vmkv bench kernels``: the Triton twins of :mod:`vmkv.kernels.triton_decode`.

The same K/V (layer 0 of an all-layers buffer ``[slot, token, layer, k|v, kv_head, head_dim]``,
the virtual layout) read three ways, with the same tile configuration:

    virtual    contiguous addressing: ``slot * stride + t``
    identity   block-table addressing over the same buffer, table = the slot's own blocks
               (the pure cost of translation)
    shuffled   block-table addressing over a ``[num_blocks, block_size, kv_head, head_dim]``
               pool whose blocks are a random permutation (what a long-running paged server has)

Each point first checks that the three give the same output (``max_abs_diff``, recorded).
Times are CUDA-event medians of ``repeats`` samples of ``inner`` back-to-back calls. Works on
CPU tensors under ``TRITON_INTERPRET=1`` (wall-clock timing; for tests only).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import torch

from vmkv.bench.common import NUM_HEADS
from vmkv.bench.memory import SMOLLM2_135M
from vmkv.bench.timing import call_ms


class _Layouts:
    """One request per slot, ``context`` tokens each, in the three layouts."""

    def __init__(self, batch: int, context: int, shape: tuple[int, int, int], block_size: int,
                 dtype: torch.dtype, device: str, seed: int) -> None:
        layers, kv_heads, head_dim = shape
        gen = torch.Generator(device=device).manual_seed(seed)
        tokens = -(-context // block_size) * block_size
        buf = torch.randn((batch, tokens, layers, 2, kv_heads, head_dim), generator=gen,
                          device=device, dtype=dtype)
        self.k, self.v = buf[:, :, 0, 0], buf[:, :, 0, 1]  # [slot, token, H, D] strided views
        self.slot_ids = torch.arange(batch, dtype=torch.int32, device=device)
        per_slot = tokens // block_size
        num_blocks = batch * per_slot
        ident = torch.arange(num_blocks, device=device).view(batch, per_slot)
        self.identity = (self.k.reshape(num_blocks, block_size, kv_heads, head_dim),
                         self.v.reshape(num_blocks, block_size, kv_heads, head_dim),
                         ident.to(torch.int32))
        perm = torch.randperm(num_blocks, generator=gen, device=device)
        pools = []
        for blocks in self.identity[:2]:
            pool = torch.empty_like(blocks)
            pool[perm] = blocks
            pools.append(pool)
        self.shuffled = (pools[0], pools[1], perm[ident].to(torch.int32).contiguous())
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)


def measure_point(batch: int, context: int, phase: str, *, prefill_len: int = 256,
                  shape: tuple[int, int, int] = SMOLLM2_135M, block_size: int = 16,
                  dtype: torch.dtype = torch.bfloat16, device: str = "cuda", repeats: int = 20,
                  warmup: int = 3, inner: int = 10, seed: int = 0) -> dict[str, Any]:
    """Median ms per call of the three addressings at one (batch, context, phase)."""
    from vmkv.kernels import triton_decode as td

    lay = _Layouts(batch, context, shape, block_size, dtype, device, seed)
    scale = shape[2] ** -0.5
    query = 1 if phase == "decode" else min(prefill_len, context)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    if phase == "decode":
        q = torch.randn((batch, NUM_HEADS, shape[2]), generator=gen, device=device, dtype=dtype)
        calls = {
            "virtual": lambda: td.decode_contiguous(q, lay.k, lay.v, lay.slot_ids, lay.seq_lens,
                                                    scale),
            **{name: (lambda k=k, v=v, t=t: td.decode_paged(q, k, v, t, lay.seq_lens, scale))
               for name, (k, v, t) in (("identity", lay.identity), ("shuffled", lay.shuffled))},
        }
    else:
        q = torch.randn((batch * query, NUM_HEADS, shape[2]), generator=gen, device=device,
                        dtype=dtype)
        cu = torch.arange(0, (batch + 1) * query, query, dtype=torch.int32, device=device)
        calls = {
            "virtual": lambda: td.prefill_contiguous(q, lay.k, lay.v, lay.slot_ids, cu,
                                                     lay.seq_lens, query, scale),
            **{name: (lambda k=k, v=v, t=t: td.prefill_paged(q, k, v, t, cu, lay.seq_lens,
                                                             query, scale))
               for name, (k, v, t) in (("identity", lay.identity), ("shuffled", lay.shuffled))},
        }
    outs = {name: fn().float() for name, fn in calls.items()}  # the twins must agree
    max_diff = max(float((o - outs["virtual"]).abs().max()) for o in outs.values())
    times: dict[str, list[float]] = {name: [] for name in calls}
    for rep in range(warmup + repeats):
        for name in calls if rep % 2 == 0 else list(calls)[::-1]:
            ms = call_ms(calls[name], device, inner)
            if rep >= warmup:
                times[name].append(ms)
    row: dict[str, Any] = {"device": device, "phase": phase, "batch": batch, "context": context,
                           "query_len": query, "dtype": str(dtype).removeprefix("torch.")}
    row.update({f"{name}_ms": statistics.median(t) for name, t in times.items()})
    row["ratio"] = row["shuffled_ms"] / row["virtual_ms"]
    row["ratio_identity"] = row["identity_ms"] / row["virtual_ms"]
    row["max_abs_diff"] = max_diff
    return row


def run(batch_sizes: Sequence[int], context_lens: Sequence[int], *,
        phases: Sequence[str] = ("decode", "prefill"), prefill_len: int = 256,
        shape: tuple[int, int, int] = SMOLLM2_135M, repeats: int = 20, warmup: int = 3,
        device: str = "cuda", dtype: torch.dtype = torch.bfloat16, inner: int = 10
        ) -> list[dict[str, Any]]:
    """Rows for every (phase, batch, context); CUDA memory is freed between points."""
    rows = []
    for phase in phases:
        for batch in batch_sizes:
            for context in context_lens:
                rows.append(measure_point(batch, context, phase, prefill_len=prefill_len,
                                          shape=shape, repeats=repeats, warmup=warmup,
                                          device=device, dtype=dtype, inner=inner))
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()
    return rows
