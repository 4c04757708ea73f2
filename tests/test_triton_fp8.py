"""fp8 KV caches in the Triton twins (``--kv-cache-dtype fp8_e4m3|fp8_e5m2`` on CUDA): the
masked write quantizes each token's head rows (D fp8 values + a float16 scale), and the decode
and prefill twins read them in both addressings.

References: a torch quantizer written here from the layout's definition (the write must match
it byte for byte under the interpreter, within one fp8 step on a GPU, whose division may round
differently), and float32 attention over the dequantized rows (the kernels must match it to
float rounding). Against the unquantized K/V the error is fp8's own, bounded below. Bytes no
write touched hold 0xFF (NaN as fp8 and as a float16 scale), so a kernel that reads past a
sequence fails. Without CUDA the kernels run under ``TRITON_INTERPRET=1`` on CPU tensors.
"""

from __future__ import annotations

import os

import pytest
import torch
import triton_required

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated (module import)

if not triton_required.EXPECTED:
    pytest.importorskip("triton", reason="triton is not installed (not a dependency here)")
from vmkv.attention.kv_store import store_triton  # noqa: E402
from vmkv.kernels import triton_decode as td  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEADS, KV_HEADS, DIM = 4, 2, 64
FORMATS = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
#: |attention over fp8 K/V - over the exact K/V| on unit-normal data: e4m3 keeps 3 mantissa
#: bits (relative step 2^-3), e5m2 2 (2^-2)
FP8_ERROR = {torch.float8_e4m3fn: 0.08, torch.float8_e5m2: 0.16}


def quantize(x: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """``x [..., D]`` -> rows ``[..., D + 2]`` of ``fmt``: values fp8(clamp(x / s)), then the
    float16 scale s = fp16(max|x| / fmt's largest value) as two little-endian bytes."""
    top = FORMATS[fmt]
    xf = x.float()
    scale16 = (xf.abs().amax(-1) / top).to(torch.float16)
    s = scale16.float()
    inv = torch.where(s > 0, 1.0 / torch.where(s > 0, s, 1.0), 0.0)
    values = (xf * inv[..., None]).clamp(-top, top).to(fmt).view(torch.uint8)
    scale_bytes = scale16.view(torch.uint8).reshape(*x.shape[:-1], 2)
    return torch.cat([values, scale_bytes], -1).view(fmt)


def dequantize(rows: torch.Tensor) -> torch.Tensor:
    """Rows ``[..., D + 2]`` of an fp8 format -> float32 ``[..., D]``."""
    raw = rows.view(torch.uint8)
    scale = raw[..., -2:].contiguous().view(torch.float16).float()  # [..., 1]
    return rows[..., :-2].float() * scale


def unwritten(shape: tuple[int, ...], fmt: torch.dtype) -> torch.Tensor:
    return torch.full(shape, 0xFF, dtype=torch.uint8, device=DEVICE).view(fmt)


def reference(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
              queries_at: list[list[int]]) -> torch.Tensor:
    """Causal float32 attention: query row j of request b at position ``queries_at[b][j]``
    sees keys 0..that position; ``q [T, Hq, D]`` packed by request."""
    out, row, group = [], 0, HEADS // KV_HEADS
    for k, v, positions in zip(keys, values, queries_at, strict=True):
        for pos in positions:
            kk = k[: pos + 1].repeat_interleave(group, 1).float()  # [n, Hq, D]
            vv = v[: pos + 1].repeat_interleave(group, 1).float()
            scores = torch.einsum("hd,nhd->hn", q[row].float(), kk) * DIM**-0.5
            out.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), vv))
            row += 1
    return torch.stack(out)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_write_quantizes_each_head_row_and_skips_padding(fmt: torch.dtype,
                                                             dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    k = (torch.randn(5, KV_HEADS, DIM, generator=gen) * 3).to(dtype).to(DEVICE)
    v = torch.randn(5, KV_HEADS, DIM, generator=gen).to(dtype).to(DEVICE)
    k[2, 1] = 0  # an all-zero head: scale 0, values 0
    rows = torch.tensor([3, -1, 7, 0, 12], device=DEVICE)
    k_cache, v_cache = (unwritten((16, KV_HEADS, DIM + 2), fmt) for _ in range(2))
    store_triton(k_cache, v_cache, rows, k, v)
    for cache, x in ((k_cache, k), (v_cache, v)):
        got = cache.view(torch.uint8)
        for t, r in enumerate(rows.tolist()):
            if r < 0:
                continue
            want = quantize(x[t], fmt).view(torch.uint8)
            if DEVICE == "cpu":
                assert torch.equal(got[r], want), (t, r)
            else:  # one fp8 step apart at most (the GPU's division)
                diff = (dequantize(got[r].view(fmt)) - dequantize(want.view(fmt))).abs()
                assert float(diff.max()) <= float(x[t].float().abs().max()) / 4
        untouched = [r for r in range(16) if r not in rows.tolist()]
        assert bool((got[untouched] == 0xFF).all())  # padding and other rows never written
    assert float(dequantize(k_cache[7])[1].abs().max()) == 0.0


def _filled(lengths: list[int], block: int, fmt: torch.dtype, dtype: torch.dtype, seed: int):
    """Per-request K/V written through the fp8 write into a slot view and a shuffled block
    pool: (keys, values, (k_slots, v_slots, slot_ids), (k_blocks, v_blocks, table))."""
    gen = torch.Generator().manual_seed(seed)
    keys = [torch.randn(n, KV_HEADS, DIM, generator=gen).to(dtype) for n in lengths]
    values = [torch.randn(n, KV_HEADS, DIM, generator=gen).to(dtype) for n in lengths]
    slot_tokens = -(-max(lengths) // block) * block + block
    slots = len(lengths) + 1
    k_slots, v_slots = (unwritten((slots, slot_tokens, KV_HEADS, DIM + 2), fmt) for _ in "kv")
    per = slot_tokens // block
    pool = slots * per
    k_blocks, v_blocks = (unwritten((pool, block, KV_HEADS, DIM + 2), fmt) for _ in "kv")
    perm = torch.randperm(pool, generator=gen)
    table = perm[: len(lengths) * per].view(len(lengths), per).to(torch.int32)
    slot_ids = torch.arange(1, len(lengths) + 1, dtype=torch.int32)  # slot 0: never read
    for b, n in enumerate(lengths):
        k, v = keys[b].to(DEVICE), values[b].to(DEVICE)
        slot_rows = int(slot_ids[b]) * slot_tokens + torch.arange(n, device=DEVICE)
        store_triton(k_slots.flatten(0, 1), v_slots.flatten(0, 1), slot_rows, k, v)
        pos = torch.arange(n)
        block_rows = (table[b, pos // block].long() * block + pos % block).to(DEVICE)
        store_triton(k_blocks.flatten(0, 1), v_blocks.flatten(0, 1), block_rows, k, v)
    virtual = (k_slots, v_slots, slot_ids.to(DEVICE))
    paged = (k_blocks, v_blocks, table.to(DEVICE))
    return keys, values, virtual, paged


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_twins_read_fp8_rows_alike(fmt: torch.dtype, dtype: torch.dtype) -> None:
    lengths, block = [37, 64, 5], 16
    keys, values, virtual, paged = _filled(lengths, block, fmt, dtype, seed=2)
    q = torch.randn(len(lengths), HEADS, DIM, generator=torch.Generator().manual_seed(3))
    q = q.to(dtype).to(DEVICE)
    seq = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    outs = [td.decode_contiguous(q, *virtual[:2], virtual[2], seq, DIM**-0.5, block_n=16),
            td.decode_paged(q, *paged[:2], paged[2], seq, DIM**-0.5, block_n=16)]
    assert torch.equal(outs[0], outs[1])  # the twins differ in addressing only
    at = [[n - 1] for n in lengths]
    deq_k = [dequantize(quantize(k, fmt)) for k in keys]
    deq_v = [dequantize(quantize(v, fmt)) for v in values]
    want = reference(q.cpu(), deq_k, deq_v, at)
    tol = 2e-4 if dtype == torch.float32 else 2e-2
    assert float((outs[0].float().cpu() - want).abs().max()) < tol
    exact = reference(q.cpu(), keys, values, at)
    assert float((outs[0].float().cpu() - exact).abs().max()) < FP8_ERROR[fmt]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_prefill_twins_read_fp8_rows_alike(fmt: torch.dtype) -> None:
    lengths, new, block = [40, 23], [9, 23], 16
    keys, values, virtual, paged = _filled(lengths, block, fmt, torch.float32, seed=4)
    q = torch.randn(sum(new), HEADS, DIM, generator=torch.Generator().manual_seed(5))
    q = q.to(DEVICE)
    seq = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0, new[0], sum(new)], dtype=torch.int32, device=DEVICE)
    outs = [td.prefill_contiguous(q, *virtual[:2], virtual[2], cu, seq, max(new), DIM**-0.5,
                                  block_m=16, block_n=16),
            td.prefill_paged(q, *paged[:2], paged[2], cu, seq, max(new), DIM**-0.5,
                             block_m=16, block_n=16)]
    assert torch.equal(outs[0], outs[1])
    at = [list(range(n - m, n)) for n, m in zip(lengths, new, strict=True)]
    want = reference(q.cpu(), [dequantize(quantize(k, fmt)) for k in keys],
                     [dequantize(quantize(v, fmt)) for v in values], at)
    assert float((outs[0].cpu() - want).abs().max()) < 2e-4


def test_an_fp8_cache_of_the_wrong_row_size_is_refused() -> None:
    q = torch.zeros(1, HEADS, DIM, device=DEVICE)
    k = unwritten((2, 16, KV_HEADS, DIM), torch.float8_e4m3fn)  # no room for the scales
    one = torch.ones(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="fp8 rows: head_dim values"):
        td.decode_contiguous(q, k, k, one, one, 1.0)
    with pytest.raises(ValueError, match="does not fit new rows"):
        store_triton(k.flatten(0, 1), k.flatten(0, 1), torch.zeros(1, dtype=torch.int64,
                                                                     device=DEVICE),
                     torch.zeros(1, KV_HEADS, DIM, device=DEVICE),
                     torch.zeros(1, KV_HEADS, DIM, device=DEVICE))


def _backend_scenario(fmt_name: str) -> None:
    """Child-process body: the CUDA attention backend (its Triton write and twins) over an fp8
    host virtual cache (tails unmapped) and an fp8 paged cache, the same steps and data."""
    from attention_scenarios import STEPS, host_virtual, paged_cache, run_scenario

    from vmkv.attention.cuda import CudaAttentionBackend
    from vmkv.attention.kv_store import store_triton

    fmt = getattr(torch, fmt_name)
    errors = {}
    for kv in (host_virtual(fmt), paged_cache(fmt)):
        backend = CudaAttentionBackend(kv, store=store_triton)  # auto: fp8 takes the twins
        assert backend.kernel == "triton", backend.kernel
        errors[kv.kv_mode], _ = run_scenario(kv, backend, STEPS, tol=0.15)
        kv.accounting.check()
    assert errors["virtual"] == errors["paged"]  # the twins: the same numbers


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_the_cuda_backend_serves_an_fp8_cache_in_both_modes(fmt: str) -> None:
    from attention_scenarios import run_child

    proc = run_child("test_triton_fp8", "_backend_scenario", fmt)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
