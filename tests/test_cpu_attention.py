"""The CPU twins (csrc/cpu_attention.cpp), decode and prefill: right answers, identical in both
addressing modes, and nothing read past each request's length (proven on real mappings in a
child)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from kernel_builds import BUILDS, use_build
from skip_policy import require, require_bf16_kernels, require_cpu_kernel

from vmkv.attention.sdpa import attend_one
from vmkv.kernels import amx_prefill, cpu_attention
from vmkv.kernels.build import load_failure


@pytest.fixture(autouse=True, scope="module")
def _built() -> None:
    """A library that did not build fails every test here, with the compiler's output."""
    require_cpu_kernel(cpu_attention)


@pytest.fixture(params=list(BUILDS))
def kernel_build(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The kernel library built for one of :data:`BUILDS`."""
    use_build(cpu_attention, request.param, monkeypatch)
    return request.param


#: the kernels' element types, and how close to the float32 reference each output must be (a
#: bfloat16 output is the float32 result rounded: relative error <= 2^-9, plus summation order)
DTYPES = {torch.float32: dict(atol=2e-6, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=8e-3)}


def close_to(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """``got`` (the kernel's output in ``dtype``) is the float32 ``want`` up to ``dtype``."""
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, **DTYPES[dtype])


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: list[torch.Tensor],
              scale: float) -> torch.Tensor:
    return torch.cat([attend_one(q[b : b + 1], k[r], v[r], len(r) - 1, scale)
                      for b, r in enumerate(rows)])


@pytest.mark.parametrize("dtype", list(DTYPES))
# (18, 2): a GQA group wider than the compiled bf16 decode kernels (the widening loops);
# (4, 1, 256): Gemma 3's heads (the widening loops: a compiled bf16 kernel for head_dim 256
# measured no faster, 0.88 ms a layer at 64 x 300 tokens either way)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"),
                         [(9, 3, 64), (4, 4, 64), (8, 2, 64), (18, 2, 64), (4, 1, 256)])
def test_contiguous_and_block_table_agree_with_sdpa(heads: int, kv_heads: int, dim: int,
                                                   dtype: torch.dtype, kernel_build: str) -> None:
    torch.manual_seed(heads)
    batch, slot, bs = 6, 96, 16
    # an all-layers style view: token stride covers 4 layers x (k, v)
    cache = torch.randn(batch * slot, 4, 2, kv_heads, dim).to(dtype)
    k, v = cache[:, 2, 0], cache[:, 2, 1]  # [rows, kv_heads, dim], strided
    lens = torch.tensor([1, 17, 16, 95, 40, 64], dtype=torch.int32)
    starts = torch.arange(batch) * slot
    q = torch.randn(batch, heads, dim).to(dtype)
    rows = [torch.arange(s, s + n) for s, n in zip(starts.tolist(), lens.tolist(), strict=True)]
    want = reference(q.float(), k.float(), v.float(), rows, 0.125)
    got = cpu_attention.decode(q, k, v, lens, 0.125, starts=starts)
    close_to(got, want, dtype)
    identity = (starts // bs)[:, None] + torch.arange(slot // bs)  # same rows, by table
    paged = cpu_attention.decode(q, k, v, lens, 0.125, block_table=identity, block_size=bs)
    assert torch.equal(paged, got)  # one kernel body: bit-identical in both modes
    # enough requests for a task per request (all its KV heads) instead of per (request, head)
    reps = -(-4 * (os.cpu_count() or 1) // batch)
    many = cpu_attention.decode(q.repeat(reps, 1, 1), k, v, lens.repeat(reps), 0.125,
                                starts=starts.repeat(reps))
    assert torch.equal(many, got.repeat(reps, 1))

    # a shuffled block pool: copy each request's blocks to random places
    num_blocks = batch * slot // bs
    perm = torch.randperm(num_blocks)
    pool_k = torch.full((num_blocks * bs, kv_heads, dim), float("nan"), dtype=dtype)
    pool_v = pool_k.clone()
    table = perm.view(batch, slot // bs)
    for b in range(batch):
        for j in range(slot // bs):
            src = slice(starts[b] + j * bs, starts[b] + (j + 1) * bs)
            dst = slice(table[b, j] * bs, (table[b, j] + 1) * bs)
            pool_k[dst], pool_v[dst] = k[src], v[src]
    shuffled = cpu_attention.decode(q, pool_k, pool_v, lens, 0.125, block_table=table,
                                    block_size=bs)
    assert torch.equal(shuffled, got)  # the same rows in other places; no NaN read


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 4), (8, 2)])
def test_prefill_chunks_agree_with_sdpa_in_both_addressings(heads: int, kv_heads: int,
                                                           dtype: torch.dtype,
                                                           kernel_build: str) -> None:
    torch.manual_seed(heads)
    dim, slot, bs = 64, 128, 16
    # (context, new tokens): fresh prompts, chunks after a context, tile edges (16, 17, 33)
    chunks = [(0, 37), (10, 16), (0, 17), (90, 33), (5, 2), (0, 128)]
    cache = torch.randn(len(chunks) * slot, 4, 2, kv_heads, dim).to(dtype)
    k, v = cache[:, 2, 0], cache[:, 2, 1]  # [rows, kv_heads, dim], strided
    starts = torch.arange(len(chunks)) * slot
    q_lens = torch.tensor([n for _, n in chunks])
    q_start = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)[:-1]])
    seq_lens = torch.tensor([c + n for c, n in chunks])
    q = torch.randn(int(q_lens.sum()), heads, dim).to(dtype)
    qf, kf, vf = q.float(), k.float(), v.float()
    want = torch.cat([attend_one(qf[s : s + n], kf[r : r + c + n], vf[r : r + c + n], c, 0.125)
                      for (c, n), s, r in zip(chunks, q_start.tolist(), starts.tolist(),
                                              strict=True)])
    got = torch.full_like(want, float("nan"), dtype=dtype)
    cpu_attention.prefill(q, k, v, q_start, q_lens, seq_lens, 0.125, got, starts=starts)
    close_to(got, want, dtype)
    identity = (starts // bs)[:, None] + torch.arange(slot // bs)
    paged = torch.full_like(want, float("nan"), dtype=dtype)
    cpu_attention.prefill(q, k, v, q_start, q_lens, seq_lens, 0.125, paged,
                          block_table=identity, block_size=bs)
    assert torch.equal(paged, got)  # one kernel body: bit-identical in both modes
    # a subset of the entries writes only its own rows of out
    some = torch.full_like(want, 7.0, dtype=dtype)
    cpu_attention.prefill(q, k, v, q_start[1:2], q_lens[1:2], seq_lens[1:2], 0.125, some,
                          starts=starts[1:2])
    rows = slice(int(q_start[1]), int(q_start[1] + q_lens[1]))
    assert torch.equal(some[rows], got[rows]) and (some[: rows.start] == 7.0).all()


def test_prefill_transposes_keys_itself_past_the_buffer_limit() -> None:
    """Past ``kTransposedMax`` bytes of key tiles each task transposes its own (long cached
    contexts); both paths give the same bits. Built with a limit of 0 to take the second."""
    flags = (*cpu_attention.FLAGS, "-DVMKV_TRANSPOSED_MAX=0")
    require(lambda: cpu_attention.build(flags) is not None,
            f"the per-task transpose build of {cpu_attention.LIBRARY}",
            lambda: load_failure(cpu_attention.LIBRARY))
    torch.manual_seed(0)
    chunks = [(0, 37), (90, 33), (5, 2)]  # (context, new tokens)
    k, v = torch.randn(2, len(chunks) * 128, 3, 64)
    starts = torch.arange(len(chunks)) * 128
    q_lens = torch.tensor([n for _, n in chunks])
    q_start = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)[:-1]])
    seq_lens = torch.tensor([c + n for c, n in chunks])
    q = torch.randn(int(q_lens.sum()), 9, 64)
    outs = []
    for lib in (cpu_attention._lib(), cpu_attention.build(flags)):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(cpu_attention, "_lib", lambda lib=lib: lib)
            out = torch.full((q.shape[0], 9 * 64), float("nan"))
            cpu_attention.prefill(q, k, v, q_start, q_lens, seq_lens, 0.125, out, starts=starts)
            outs.append(out)
    assert not outs[0].isnan().any() and torch.equal(outs[0], outs[1])


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 8, 64), (4, 2, 128)])
def test_amx_prefill_agrees_with_sdpa_in_both_addressings(heads: int, kv_heads: int,
                                                          dim: int) -> None:
    """The bf16 AMX prefill twins: fresh prompts, chunks after a context, tile (64 keys) and
    block (32 queries) edges, and a chunk past the 512-key score chunk; one kernel body per
    mode, so the block table gives the same bits, also from a shuffled pool."""
    require_bf16_kernels()
    torch.manual_seed(heads + dim)
    slot, bs = 1152, 16
    chunks = [(0, 37), (10, 16), (0, 64), (63, 33), (5, 2), (0, 128), (300, 700)]
    cache = torch.randn(len(chunks) * slot, 2, 2, kv_heads, dim).to(torch.bfloat16)
    k, v = cache[:, 1, 0], cache[:, 1, 1]  # [rows, kv_heads, dim], strided
    starts = torch.arange(len(chunks)) * slot
    q_lens = torch.tensor([n for _, n in chunks])
    q_start = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)[:-1]])
    seq_lens = torch.tensor([c + n for c, n in chunks])
    q = torch.randn(int(q_lens.sum()), heads, dim).to(torch.bfloat16)
    qf, kf, vf = q.float(), k.float(), v.float()
    want = torch.cat([attend_one(qf[s : s + n], kf[r : r + c + n], vf[r : r + c + n], c, 0.125)
                      for (c, n), s, r in zip(chunks, q_start.tolist(), starts.tolist(),
                                              strict=True)])
    got = torch.full((q.shape[0], heads * dim), float("nan"), dtype=torch.bfloat16)
    amx_prefill.prefill(q, k, v, q_start, q_lens, seq_lens, 0.125, got, starts=starts)
    close_to(got, want, torch.bfloat16)
    table = (starts // bs)[:, None] + torch.arange(slot // bs)
    perm = torch.randperm(table.numel())
    pool_k = torch.full((table.numel() * bs, kv_heads, dim), float("nan"), dtype=torch.bfloat16)
    pool_v = pool_k.clone()
    for old, new in enumerate(perm.tolist()):
        pool_k[new * bs : (new + 1) * bs] = k[old * bs : (old + 1) * bs]
        pool_v[new * bs : (new + 1) * bs] = v[old * bs : (old + 1) * bs]
    paged = torch.full_like(got, float("nan"))
    amx_prefill.prefill(q, pool_k, pool_v, q_start, q_lens, seq_lens, 0.125, paged,
                        block_table=perm[table], block_size=bs)
    assert torch.equal(paged, got)  # the same rows elsewhere, bit for bit; no NaN read


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("batch", [3, 64])  # a task per (request, head) / per request
def test_decode_stores_the_new_rows_then_attends(paged: bool, batch: int, dtype: torch.dtype,
                                                 kernel_build: str) -> None:
    torch.manual_seed(batch)
    heads, kv_heads, dim, slot, bs = 9, 3, 64, 48, 16
    k = torch.randn(batch * slot, kv_heads, dim).to(dtype)
    v = torch.randn(batch * slot, kv_heads, dim).to(dtype)
    lens = torch.randint(1, slot + 1, (batch,), dtype=torch.int32)
    starts = torch.arange(batch) * slot
    new_rows = starts + lens.to(torch.int64) - 1  # each request's last token
    k[new_rows], v[new_rows] = float("nan"), float("nan")  # not yet written
    # the model's layout: K and V heads are slices of one [B, Hq + 2 Hkv, D] tensor
    qkv = torch.randn(batch, heads + 2 * kv_heads, dim).to(dtype)
    q, k_new, v_new = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    addressing = (dict(block_table=(starts // bs)[:, None] + torch.arange(slot // bs),
                       block_size=bs) if paged else dict(starts=starts))
    want_k, want_v = k.clone(), v.clone()
    want_k[new_rows], want_v[new_rows] = k_new, v_new
    want = cpu_attention.decode(q, want_k, want_v, lens, 0.125, **addressing)
    out = torch.full((batch, heads * dim), float("nan"), dtype=dtype)
    got = cpu_attention.decode(q, k, v, lens, 0.125, new_kv=(k_new, v_new), out=out,
                               **addressing)
    assert got is out and torch.equal(got, want)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)  # those rows, and only those
    with pytest.raises(ValueError, match="new K/V rows must be"):
        cpu_attention.decode(q, k, v, lens, 0.125, new_kv=(k_new[:1], v_new), **addressing)


def test_bad_arguments_are_value_errors() -> None:
    q, k = torch.randn(1, 4, 8), torch.randn(4, 2, 8)
    lens = torch.tensor([2], dtype=torch.int32)
    with pytest.raises(ValueError, match="exactly one of starts or block_table"):
        cpu_attention.decode(q, k, k, lens, 1.0)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_attention.decode(q.half(), k.half(), k.half(), lens, 1.0, starts=torch.zeros(1))
    with pytest.raises(ValueError, match="bad arguments"):
        cpu_attention.decode(torch.randn(1, 3, 8), k, k, lens, 1.0, starts=torch.zeros(1))
    one = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="bad arguments to the CPU prefill kernel"):
        cpu_attention.prefill(torch.randn(4, 4, 8), k, k, one * 0, one * 4, one * 3, 1.0,
                              torch.empty(4, 32), starts=torch.zeros(1))  # 4 new > 3 cached
    with pytest.raises(ValueError, match="out must be"):
        cpu_attention.prefill(torch.randn(4, 4, 8), k, k, one * 0, one * 4, one * 4, 1.0,
                              torch.empty(4, 8), starts=torch.zeros(1))


_CHILD = textwrap.dedent(
    """
    import sys, torch
    from vmkv.kernels import amx_prefill, cpu_attention
    from vmkv.kv import KVSpec, VirtualKVCache
    from vmkv.memory import PagePool
    from vmkv.memory.host import HostMemoryBackend
    kind, kv_heads, dim = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    dtype = torch.bfloat16 if kind == "amx-prefill" else torch.float32
    spec = KVSpec(num_layers=2, num_kv_heads=kv_heads, head_dim=dim, dtype=dtype)
    n = 65536 // spec.bytes_per_token  # tokens per 64 KiB page: 32 float32, 64 bfloat16
    kv = VirtualKVCache(spec, pool=PagePool(HostMemoryBackend(65536, 8), 8), num_slots=2,
                        max_model_len=max(256, 4 * n))
    kv.allocate("a", n)  # exactly one page mapped in each slot
    kv.allocate("b", n)
    k, v = kv.layer_kv(1)
    starts = torch.tensor([kv.slot("a"), kv.slot("b")]) * kv.layout.slot_tokens
    for rid in "ab":
        k[kv.slot(rid), :n] = 1.0
        v[kv.slot(rid), :n] = 2.0
    lens = torch.tensor([n, n + int(sys.argv[1])], dtype=torch.int32)
    if kind == "decode":
        out = cpu_attention.decode(torch.ones(2, 2 * kv_heads, dim), k.flatten(0, 1),
                                   v.flatten(0, 1), lens, 0.125, starts=starts)
    else:  # two chunks of 20 new tokens: the last query of b sees its last row
        prefill = amx_prefill.prefill if kind == "amx-prefill" else cpu_attention.prefill
        out = torch.empty(40, 4 * 64, dtype=dtype)
        prefill(torch.ones(40, 4, 64, dtype=dtype), k.flatten(0, 1), v.flatten(0, 1),
                torch.tensor([0, 20]), torch.tensor([20, 20]), lens, 0.125, out, starts=starts)
    print(float(out.mean()), flush=True)
    """
)


#: (kind, KV heads, head_dim); decode also with 32-byte rows, shorter than the cache lines its
#: whole-row reads load (the last one must stay inside the row)
READERS = [("decode", 2, 64), ("decode", 1, 8), ("prefill", 2, 64), ("amx-prefill", 2, 64)]


@pytest.mark.parametrize(("kind", "kv_heads", "dim"), READERS)
@pytest.mark.parametrize(("extra", "returncode"), [(0, 0), (1, -11)])
def test_the_kernel_reads_only_mapped_tokens(extra: int, returncode: int, kind: str,
                                             kv_heads: int, dim: int) -> None:
    if kind == "amx-prefill":
        require_bf16_kernels()
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(extra), kind, str(kv_heads),
                           str(dim)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == returncode, proc.stderr
    if returncode == 0:
        assert float(proc.stdout) == 2.0
