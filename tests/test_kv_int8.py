"""An int8 KV cache on the CPU (``--kv-cache-dtype int8``): the flag and its refusals, the
kernels against a float reference and each other, and the real model in both KV modes.

Rules: the quantising store writes exactly what :func:`quantize_reference` computes; decode
over int8 rows is within float rounding of float attention over the dequantised rows (the
query's int16 quantisation adds ~2^-16 relative); virtual and paged addressing give
bit-identical outputs (kernels) and identical tokens (engine), with prefix hits, a fork (n=2)
and swap preemption carrying the scales; teacher-forced top-1 agreement with the bfloat16 cache
on a short text is at least 95 % (``vmkv bench accuracy`` holds the >= 98 % bar over >= 2,000
positions).
"""

from __future__ import annotations

import pytest
import torch
from kernel_builds import BUILDS, use_build
from skip_policy import require_cpu_kernel

from vmkv import LLM, SamplingParams
from vmkv.config import EngineConfig
from vmkv.kernels import cpu_attention, cpu_attention_int8
from vmkv.kernels.cpu_attention_int8 import (
    dequantize_reference,
    hadamard_reference,
    quantize_reference,
)
from vmkv.kv import KVSpec

B, HEADS, KV_HEADS, DIM, SLOT = 5, 9, 3, 64, 300


@pytest.fixture(autouse=True, scope="module")
def _kernels() -> None:
    require_cpu_kernel(cpu_attention)
    require_cpu_kernel(cpu_attention_int8)


def test_the_flag_refuses_what_a_device_cannot_do() -> None:
    assert EngineConfig(kv_cache_dtype="auto", dtype="float32").kv_cache_dtype_name == "float32"
    assert EngineConfig(kv_cache_dtype="int8", dtype="float32").kv_cache_dtype_name == "int8"
    with pytest.raises(ValueError, match="fp8 KV is a GPU format.*auto, float32, int8"):
        EngineConfig(kv_cache_dtype="fp8_e4m3", dtype="float32")
    with pytest.raises(ValueError, match="choose --dtype float32"):
        EngineConfig(kv_cache_dtype="float32", dtype="bfloat16")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int4")


def test_an_int8_spec_holds_a_scale_beside_each_head() -> None:
    bf16 = KVSpec(30, 3, 64, torch.bfloat16)
    int8 = KVSpec(30, 3, 64, torch.int8)
    assert int8.row_dim == 66 and int8.head_bytes == 3 * 66
    assert bf16.bytes_per_token / int8.bytes_per_token >= 1.9  # tokens per GiB


def _cache(dtype: torch.dtype, kv_heads: int = KV_HEADS, dim: int = DIM
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(B * SLOT, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(B * SLOT, kv_heads, dim, generator=gen).to(dtype)
    kc = torch.zeros(B * SLOT, kv_heads, dim + 2, dtype=torch.int8)
    vc = torch.zeros_like(kc)
    cpu_attention_int8.store(kc, vc, torch.arange(B * SLOT), k, v)
    return kc, vc, k, v


def _paged_copy(kc: torch.Tensor, vc: torch.Tensor, block_size: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same rows in shuffled blocks of ``block_size``, and the block table."""
    width = -(-SLOT // block_size)
    num_blocks = B * width + 1
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1))
    table = perm[: B * width].view(B, width).to(torch.int32)
    pk = torch.zeros(num_blocks * block_size, *kc.shape[1:], dtype=torch.int8)
    pv = torch.zeros_like(pk)
    for b in range(B):
        for t in range(SLOT):
            row = int(table[b, t // block_size]) * block_size + t % block_size
            pk[row], pv[row] = kc[b * SLOT + t], vc[b * SLOT + t]
    return pk, pv, table


@pytest.fixture(params=list(BUILDS))
def int8_build(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The int8 kernels built for one of :data:`BUILDS` (what ``decode`` and ``store`` call)."""
    use_build(cpu_attention_int8, request.param, monkeypatch)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# the compiled tasks' head_dims (64, 128) and GQA groups (3, 1, 4), and a portable-only dim (96)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"),
                         [(HEADS, KV_HEADS, DIM), (4, 4, 64), (8, 2, 128), (2, 1, 96)])
def test_decode_over_int8_rows_is_float_attention_over_their_values(
        dtype: torch.dtype, heads: int, kv_heads: int, dim: int, int8_build: str) -> None:
    kc, vc, k, v = _cache(dtype, kv_heads, dim)
    assert torch.equal(kc, quantize_reference(k)) and torch.equal(vc, quantize_reference(v))
    # symmetric int8 per token and head of the rotated row: each value within half a step
    basis = hadamard_reference if cpu_attention_int8.rotated(dim) else torch.Tensor.float
    rot = basis(k)
    err = (basis(dequantize_reference(kc)) - rot).abs()
    assert bool((err <= 0.5 * rot.abs().amax(-1, keepdim=True) / 127 * 1.01).all())
    q = torch.randn(B, heads, dim, generator=torch.Generator().manual_seed(2)).to(dtype)
    lens = torch.tensor([SLOT, 1, 17, 64, 129], dtype=torch.int32)
    starts = torch.arange(B, dtype=torch.int64) * SLOT
    got = cpu_attention_int8.decode(q, kc, vc, lens, 0.125, starts=starts)
    want = cpu_attention.decode(q.float(), dequantize_reference(kc), dequantize_reference(vc),
                                lens, 0.125, starts=starts)
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # bf16: the output's rounding
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    for window in (0, 40):  # the twins: the same bits from a shuffled block table
        pk, pv, table = _paged_copy(kc, vc, 16)
        virtual = cpu_attention_int8.decode(q, kc, vc, lens, 0.125, starts=starts, window=window)
        paged = cpu_attention_int8.decode(q, pk, pv, lens, 0.125, block_table=table,
                                          block_size=16, window=window)
        assert torch.equal(virtual, paged)
    # the fused write: the new rows quantised by the decode call are the store's
    kn, vn = (torch.randn(B, kv_heads, dim).to(dtype) for _ in range(2))
    fused_k, fused_v = kc.clone(), vc.clone()
    fused = cpu_attention_int8.decode(q, fused_k, fused_v, lens, 0.125, starts=starts,
                                      new_kv=(kn, vn))
    kc2, vc2 = kc.clone(), vc.clone()
    cpu_attention_int8.store(kc2, vc2, starts + lens.long() - 1, kn, vn)
    assert torch.equal(fused_k, kc2) and torch.equal(fused_v, vc2)
    assert torch.equal(fused, cpu_attention_int8.decode(q, kc2, vc2, lens, 0.125, starts=starts))


def test_prefill_reads_the_dequantised_rows_in_both_addressings() -> None:
    kc, vc, _, _ = _cache(torch.float32)
    pk, pv, table = _paged_copy(kc, vc, 16)
    lens = torch.tensor([SLOT, 3, 40, 64, 130], dtype=torch.int32)
    first = torch.tensor([0, 0, 5, 0, 100], dtype=torch.int32)
    starts = torch.arange(B, dtype=torch.int64) * SLOT
    dk, dv, rows = cpu_attention_int8.dequantize(kc, vc, lens, first, torch.float32,
                                                 starts=starts)
    pdk, pdv, prows = cpu_attention_int8.dequantize(pk, pv, lens, first, torch.float32,
                                                    block_table=table, block_size=16)
    ref = dequantize_reference(kc)
    for b in range(B):
        lo, n = int(first[b]), int(lens[b])
        got = slice(int(rows[b]) + lo, int(rows[b]) + n)
        assert torch.equal(dk[got], ref[b * SLOT + lo: b * SLOT + n])
        assert torch.equal(pdk[got], dk[got]) and torch.equal(pdv[got], dv[got])
    assert torch.equal(rows, prows)


def test_bad_arguments_are_refused() -> None:
    kc, vc, k, _ = _cache(torch.float32)
    with pytest.raises(ValueError, match="int8 cache rows must be int8"):
        cpu_attention_int8.store(kc.float(), vc.float(), torch.arange(3), k[:3], k[:3])
    with pytest.raises(ValueError, match="new k rows"):
        cpu_attention_int8.store(kc, vc, torch.arange(3), k[:3, :, :32], k[:3, :, :32])
    with pytest.raises(ValueError, match="exactly one of starts or block_table"):
        cpu_attention_int8.decode(torch.zeros(1, HEADS, DIM), kc, vc,
                                  torch.ones(1, dtype=torch.int32), 1.0)


PROMPTS = ["The history of the Roman empire", "def fibonacci(n):",
           "Write a short poem about the sea.", "List three colours and a number."]
SYSTEM = ("You are a careful assistant. Answer briefly, precisely and politely. " * 12).strip()


def _run(kv_mode: str) -> dict:
    """One int8 engine: prefix hits (a shared 150-token system prompt), a fork (n=2) and swap
    preemption (about three requests' worth of KV memory)."""
    llm = LLM(kv_mode=kv_mode, kv_cache_dtype="int8", max_model_len=512, max_num_seqs=8,
              kv_cache_memory="5M", preemption_mode="swap", max_num_batched_tokens=256,
              block_size=16)
    engine = llm.engine
    try:
        assert engine.kv.spec.dtype == torch.int8
        greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        first = llm.generate(f"{SYSTEM}\n{PROMPTS[0]}", greedy, use_tqdm=False)[0]
        outs = llm.generate([f"{SYSTEM}\n{p}" for p in PROMPTS[1:]] + PROMPTS, greedy,
                            use_tqdm=False)
        fork = llm.generate(PROMPTS[2], SamplingParams(n=2, temperature=1.0, seed=3,
                                                       max_tokens=16, ignore_eos=True),
                            use_tqdm=False)[0]
        kv = engine.kv
        kv.accounting.check()
        usage = kv.accounting.usage
        assert usage.num_requests == 0 and usage.bytes_in_use == 0  # no page, block or scale
        return {"tokens": [o.outputs[0].token_ids for o in [first, *outs]],
                "cached": [o.num_cached_tokens for o in outs[:3]],
                "fork": [c.token_ids for c in fork.outputs],
                "preemptions": engine.scheduler.stats.num_preemptions}
    finally:
        llm.engine.close()


@pytest.mark.usefixtures("default_model")
def test_int8_tokens_are_equal_in_both_modes_through_prefix_hits_forks_and_swaps() -> None:
    virtual, paged = _run("virtual"), _run("paged")
    for got in (virtual, paged):
        assert max(got["cached"]) > 0, got["cached"]  # prefix hits (some evicted: tight)
        assert got["preemptions"] > 0  # swapped out and back
        assert got["fork"][0] != got["fork"][1]
    assert virtual["tokens"] == paged["tokens"]
    assert virtual["fork"] == paged["fork"]


@pytest.mark.usefixtures("default_model")
def test_int8_tracks_the_bfloat16_cache_on_real_text() -> None:
    from vmkv.bench import accuracy

    result = accuracy.run(["none:bfloat16:int8"], "none:bfloat16", positions=255, chunk=256)
    int8 = next(r for r in result["rows"] if r["variant"] == "none:bfloat16:int8")
    assert int8["positions"] == 255
    assert int8["agreement"] >= 0.95 and abs(int8["ppl_ratio"] - 1) <= 0.02, int8
