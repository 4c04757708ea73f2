"""The Triton twins with a sliding window: decode (split-KV too) and prefill, contiguous and
paged, against a float32 masked softmax; every row before a request's window holds NaN (a page
or block given back), so a kernel that reads one fails. Without CUDA the kernels run under
``TRITON_INTERPRET=1`` (small shapes)."""

from __future__ import annotations

import os

import pytest
import torch
import triton_required

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated (module import)

if not triton_required.EXPECTED:
    pytest.importorskip("triton", reason="triton is not installed (not a dependency here)")
from vmkv.kernels import triton_decode as td  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KV_HEADS, HEAD_DIM, SLOT, BS = 1, 32, 96, 16
SCALE = HEAD_DIM**-0.5


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, context_len: int,
               window: int) -> torch.Tensor:
    """float32 attention of ``q [n, Hq, D]`` at positions ``context_len ..``; position p sees
    keys ``p - window + 1 .. p``."""
    n, heads, _ = q.shape
    group = heads // keys.shape[1]
    k = keys.float().repeat_interleave(group, 1).transpose(0, 1)  # [Hq, len, D]
    v = values.float().repeat_interleave(group, 1).transpose(0, 1)
    scores = q.float().transpose(0, 1) @ k.transpose(1, 2) * SCALE  # [Hq, n, len]
    key = torch.arange(keys.shape[0])[None, :]
    pos = (context_len + torch.arange(n))[:, None]
    scores = scores.masked_fill(~((key <= pos) & (key > pos - window)), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)  # [n, Hq, D]


def _caches(lens: list[int], firsts: list[int], seed: int
            ) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, tuple]]:
    """Per-request K/V and the two addressings of the same rows: slots ``[B, SLOT, H, D]``
    and a shuffled block pool with its table; rows before ``firsts[b]`` and past ``lens[b]``
    are NaN in both."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(lens)
    keys = [torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen) for n in lens]
    values = [torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen) for n in lens]
    k = torch.full((batch, SLOT, KV_HEADS, HEAD_DIM), float("nan"))
    v = k.clone()
    for b, (n, f) in enumerate(zip(lens, firsts, strict=True)):
        k[b, f:n], v[b, f:n] = keys[b][f:], values[b][f:]
    per = SLOT // BS
    perm = torch.randperm(batch * per, generator=gen)
    k_pool = torch.empty(batch * per, BS, KV_HEADS, HEAD_DIM)
    v_pool = torch.empty_like(k_pool)
    k_pool[perm] = k.reshape(batch * per, BS, KV_HEADS, HEAD_DIM)
    v_pool[perm] = v.reshape(batch * per, BS, KV_HEADS, HEAD_DIM)
    table = perm.view(batch, per).to(torch.int32)
    slots = torch.arange(batch, dtype=torch.int32)
    on = {"device": DEVICE}
    return keys, values, {"contiguous": (k.to(**on), v.to(**on), slots.to(**on)),
                          "paged": (k_pool.to(**on), v_pool.to(**on), table.to(**on))}


@pytest.mark.parametrize(("window", "num_splits"), [(5, 1), (20, 1), (20, 3), (1, 2)])
def test_decode_window(window: int, num_splits: int) -> None:
    lens = [1, 17, 40, 96]
    keys, values, caches = _caches(lens, [max(0, n - window) for n in lens], seed=window)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(len(lens), 2 * KV_HEADS, HEAD_DIM, generator=gen)
    ref = torch.stack([_reference(q[b : b + 1], keys[b], values[b], n - 1, window)[0]
                       for b, n in enumerate(lens)])
    seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    for name, (k, v, index) in caches.items():
        fn = td.decode_paged if name == "paged" else td.decode_contiguous
        out = fn(q.to(DEVICE), k, v, index, seq, SCALE, num_splits=num_splits, block_n=16,
                 window=window)
        assert torch.isfinite(out).all(), f"{name}: read a row before the window"
        torch.testing.assert_close(out.float().cpu(), ref, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("window", [3, 20])
def test_prefill_window(window: int) -> None:
    requests = [(0, 30), (40, 1), (23, 20), (70, 26)]  # (context, new tokens)
    lens = [c + n for c, n in requests]
    firsts = [max(0, c - window + 1) for c, _ in requests]
    keys, values, caches = _caches(lens, firsts, seed=window + 1)
    query_lens = [n for _, n in requests]
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(sum(query_lens), 2 * KV_HEADS, HEAD_DIM, generator=gen)
    cu = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    ref = torch.cat([_reference(q[cu[b] : cu[b + 1]], keys[b], values[b], c, window)
                     for b, (c, _) in enumerate(requests)])
    seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    for name, (k, v, index) in caches.items():
        fn = td.prefill_paged if name == "paged" else td.prefill_contiguous
        out = fn(q.to(DEVICE), k, v, index, cu.to(DEVICE), seq, max(query_lens), SCALE,
                 block_m=16, block_n=16, window=window)
        assert torch.isfinite(out).all(), f"{name}: read a row before the window"
        torch.testing.assert_close(out.float().cpu(), ref, atol=2e-4, rtol=2e-4)
