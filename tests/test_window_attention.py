"""Sliding-window attention in every CPU path: the decode and prefill twins (both addressings,
every build) and per-request SDPA, against a plain masked softmax; and nothing before a
request's window is read (the rows there hold NaN, as an unmapped page or a freed block
would hold anything)."""

from __future__ import annotations

import pytest
import torch
from skip_policy import require_cpu_kernel
from test_cpu_attention import DTYPES, kernel_build  # noqa: F401 (a fixture)

from vmkv.attention.sdpa import attend_each, window_start
from vmkv.kernels import cpu_attention


@pytest.fixture(autouse=True, scope="module")
def _built() -> None:
    require_cpu_kernel(cpu_attention)


def close_to(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """As test_cpu_attention's, a little wider in float32 (head_dim 256 sums more terms)."""
    assert got.dtype == dtype
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else DTYPES[dtype]
    torch.testing.assert_close(got.float(), want, **tol)


def masked_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int,
                     scale: float, window: int) -> torch.Tensor:
    """``q [n, H, D]`` at positions ``context_len ..`` over ``k, v [context_len + n, Hkv, D]``;
    query p sees keys ``p - window + 1 .. p`` (float64 softmax, no kernel)."""
    n, heads, dim = q.shape
    group = heads // k.shape[1]
    kk = k.double().repeat_interleave(group, 1)  # [S, H, D]
    vv = v.double().repeat_interleave(group, 1)
    scores = torch.einsum("nhd,shd->hns", q.double(), kk) * scale  # [H, n, S]
    pos = torch.arange(n)[:, None] + context_len
    key = torch.arange(k.shape[0])[None]
    seen = (key <= pos) & (key > pos - window if window else True)  # [n, S]
    scores = scores.masked_fill(~seen, float("-inf"))
    out = torch.einsum("hns,shd->nhd", scores.softmax(-1), vv)
    return out.reshape(n, heads * dim).float()


def poison_before_window(k: torch.Tensor, v: torch.Tensor, starts: list[int], first: list[int]
                         ) -> None:
    """NaN in every request's rows before the first token it may read."""
    for s, f in zip(starts, first, strict=True):
        k[s : s + f] = float("nan")
        v[s : s + f] = float("nan")


def shuffled_pool(k: torch.Tensor, v: torch.Tensor, slot: int, bs: int, batch: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same rows in a shuffled block pool: (pool K, pool V, block table)."""
    per = slot // bs
    perm = torch.randperm(batch * per)
    table = perm.view(batch, per)
    pool_k, pool_v = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
    for b in range(batch):
        for j in range(per):
            src = slice(b * slot + j * bs, b * slot + (j + 1) * bs)
            dst = slice(int(table[b, j]) * bs, (int(table[b, j]) + 1) * bs)
            pool_k[dst], pool_v[dst] = k[src], v[src]
    return pool_k, pool_v, table


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 1, 256), (8, 2, 64), (4, 4, 128)])
@pytest.mark.parametrize("window", [1, 7, 40])
def test_decode_window(heads: int, kv_heads: int, dim: int, window: int, dtype: torch.dtype,
                       kernel_build: str) -> None:  # noqa: F811
    torch.manual_seed(window + dim)
    slot, bs = 112, 16
    lens = [1, 7, 8, 41, 100, 112]
    batch = len(lens)
    k = torch.randn(batch * slot, kv_heads, dim).to(dtype)
    v = torch.randn(batch * slot, kv_heads, dim).to(dtype)
    q = torch.randn(batch, heads, dim).to(dtype)
    starts = [b * slot for b in range(batch)]
    want = torch.cat([masked_reference(q[b : b + 1].float(), k[s : s + n].float(),
                                       v[s : s + n].float(), n - 1, 0.125, window)
                      for b, (s, n) in enumerate(zip(starts, lens, strict=True))])
    poison_before_window(k, v, starts, [max(0, n - window) for n in lens])
    seq = torch.tensor(lens, dtype=torch.int32)
    got = cpu_attention.decode(q, k, v, seq, 0.125, starts=torch.tensor(starts), window=window)
    close_to(got, want, dtype)
    pool_k, pool_v, table = shuffled_pool(k, v, slot, bs, batch)
    paged = cpu_attention.decode(q, pool_k, pool_v, seq, 0.125, block_table=table,
                                 block_size=bs, window=window)
    assert torch.equal(paged, got)  # one body: the same bits from scattered blocks


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 1, 256), (9, 3, 64)])
@pytest.mark.parametrize("window", [1, 16, 33])
def test_prefill_window(heads: int, kv_heads: int, dim: int, window: int, dtype: torch.dtype,
                        kernel_build: str) -> None:  # noqa: F811
    torch.manual_seed(window + heads)
    slot, bs = 128, 16
    # (context, new tokens): fresh prompts longer than the window, chunks after a context
    # that reaches back past it, tile edges
    chunks = [(0, 37), (10, 16), (0, 17), (90, 33), (5, 2), (0, 128), (70, 1)]
    batch = len(chunks)
    k = torch.randn(batch * slot, kv_heads, dim).to(dtype)
    v = torch.randn(batch * slot, kv_heads, dim).to(dtype)
    starts = [b * slot for b in range(batch)]
    q_lens = torch.tensor([n for _, n in chunks])
    q_start = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)[:-1]])
    seq_lens = torch.tensor([c + n for c, n in chunks])
    q = torch.randn(int(q_lens.sum()), heads, dim).to(dtype)
    want = torch.cat([masked_reference(q[s : s + n].float(), k[r : r + c + n].float(),
                                       v[r : r + c + n].float(), c, 0.125, window)
                      for (c, n), s, r in zip(chunks, q_start.tolist(), starts, strict=True)])
    poison_before_window(k, v, starts, [window_start(c, window) for c, _ in chunks])
    got = torch.full_like(want, float("nan"), dtype=dtype)
    cpu_attention.prefill(q, k, v, q_start, q_lens, seq_lens, 0.125, got,
                          starts=torch.tensor(starts), window=window)
    close_to(got, want, dtype)
    pool_k, pool_v, table = shuffled_pool(k, v, slot, bs, batch)
    paged = torch.full_like(got, float("nan"))
    cpu_attention.prefill(q, pool_k, pool_v, q_start, q_lens, seq_lens, 0.125, paged,
                          block_table=table, block_size=bs, window=window)
    assert torch.equal(paged, got)


@pytest.mark.parametrize("paged", [False, True])
def test_sdpa_reads_a_view_from_the_window(paged: bool) -> None:
    """The SDPA path (no kernels) takes the rows from the window's first token on: a view of
    the slot from there (virtual), a gather of those rows (paged)."""
    torch.manual_seed(1)
    heads, kv_heads, dim, slot, window = 4, 2, 32, 64, 9
    chunks = [(0, 30), (20, 5), (40, 1)]
    k = torch.randn(len(chunks) * slot, kv_heads, dim)
    v = torch.randn(len(chunks) * slot, kv_heads, dim)
    starts = [b * slot for b in range(len(chunks))]
    q = torch.randn(sum(n for _, n in chunks), heads, dim)
    offsets = [0, 30, 35]
    want = torch.cat([masked_reference(q[o : o + n], k[s : s + c + n], v[s : s + c + n], c,
                                       0.2, window)
                      for (c, n), o, s in zip(chunks, offsets, starts, strict=True)])
    poison_before_window(k, v, starts, [window_start(c, window) for c, _ in chunks])
    rows: list[slice | torch.Tensor | None] = [
        torch.arange(s, s + c + n) if paged else slice(s, s + c + n)
        for (c, n), s in zip(chunks, starts, strict=True)]
    out = torch.full((q.shape[0], heads * dim), float("nan"))
    attend_each(out, q, k, v, [c for c, _ in chunks], [n for _, n in chunks], rows, 0.2, window)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_negative_window_is_a_value_error() -> None:
    q, k = torch.randn(1, 4, 8), torch.randn(4, 2, 8)
    with pytest.raises(ValueError, match="sliding window must be positive"):
        cpu_attention.decode(q, k, k, torch.tensor([2], dtype=torch.int32), 1.0,
                             starts=torch.zeros(1), window=-1)
