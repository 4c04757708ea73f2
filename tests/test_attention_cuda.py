"""CUDA attention backends: metadata, call plumbing, kernels vs a float32 reference.

No GPU exists on CI, so the CPU tests split the backends in two:

* **Real code on CPU**: step building (exact arrays), the single staging copy, graph padding,
  block-table refresh, kernel choice, the masked Triton K/V write and the Triton twins (under
  ``TRITON_INTERPRET=1``), and the SDPA fallback, on real host KV caches (mmap) whose pages past
  each request's length are *unmapped* and whose mapped rows past the length hold NaN: any
  over-read either dies with SIGSEGV (the scenarios run in a child process) or poisons the
  result.
* **Injected kernels**: ``aten._flash_attention_forward`` and ``flash_attn_with_kvcache`` do not
  run on CPU. Tests inject a float32 reference with the same signature that implements their
  documented semantics (varlen rows ``cum_seq_k[b] ..+ seqused_k[b]``, bottom-right causal,
  ``cache_batch_idx``, ``block_table``), and also call the real aten op on meta tensors (torch
  2.13's CPU build registers a Meta kernel) to check shapes and keyword names. **The real
  FlashAttention kernels run only on a GPU**: the ``gpu``-marked tests below and
  ``benchmarks/gpu/check.sh`` prove them.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import triton_required
from attention_scenarios import (  # sets TRITON_INTERPRET without CUDA
    HEAD_DIM,
    KV_HEADS,
    LAYERS,
    STEPS,
    FakeFlashAttn,
    ReferenceVarlen,
    boundary_steps,
    cuda_virtual,
    host_virtual,
    paged_cache,
    run_child,
    run_scenario,
)
from skip_policy import cpu_only
from triton_required import needs_triton

from vmkv.attention import create_attention_backend
from vmkv.attention.cuda import CudaAttentionBackend
from vmkv.attention.kernel_choice import aten_flash_kwargs, requested_kernel, resolve_kernel
from vmkv.attention.kv_store import store_index_copy
from vmkv.attention.staging import StagingBuffer, layout
from vmkv.config import EngineConfig

CUDA = torch.cuda.is_available()


def _virtual_scenario(kernel: str, dtype_name: str) -> None:
    """Child-process body: a host virtual cache (tails unmapped) through ``kernel``."""
    dtype = getattr(torch, dtype_name)
    kv = host_virtual(dtype)
    varlen = ReferenceVarlen()
    fa = FakeFlashAttn()
    backend = CudaAttentionBackend(kv, kernel, varlen_fn=varlen, flash_attn=fa)
    assert backend.kernel == kernel, backend.kernel
    run_scenario(kv, backend, STEPS, tol=2e-2 if dtype != torch.float32 else 1e-4)
    if kernel == "aten-flash":  # one call per layer and step; decode steps pass max_q == 1
        assert len(varlen.calls) == LAYERS * len(STEPS)
        assert [c["max_q"] for c in varlen.calls[::LAYERS]] == [37, 63, 1, 1, 5]
    if kernel == "flash-attn":
        assert set(fa.calls) == {"slots"}
    assert backend.staging.num_copies == len(STEPS)  # one host->device copy per step
    kv.accounting.check()


# -- CPU tests ----------------------------------------------------------------------------------
@cpu_only  # plumbing (the GPU runs the real kernels below)
@pytest.mark.parametrize(("kernel", "dtype"), [
    ("aten-flash", "float16"),  # injected reference + meta-shape check of the real op
    ("flash-attn", "bfloat16"),  # injected fake package
    pytest.param("triton", "float16", marks=needs_triton),  # the real Triton twin, interpreted
    ("sdpa", "float32"),
])
def test_virtual_backend_on_a_host_cache_with_unmapped_tails(kernel: str, dtype: str) -> None:
    proc = run_child("test_attention_cuda", "_virtual_scenario", kernel, dtype)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"


def test_the_scenario_detects_a_one_token_over_read() -> None:
    """The harness can fail: a kernel that reads one row more dies (SIGSEGV) or sees NaN."""
    proc = run_child("test_attention_cuda", "_over_read_scenario")
    assert proc.returncode != 0
    assert proc.returncode == -11 or "NaN" in proc.stderr, proc.stderr[-2000:]


def _over_read_scenario() -> None:
    kv = host_virtual(torch.float16)
    varlen = ReferenceVarlen()

    def over(q, k, v, cu_q, cu_k, max_q, max_k, *rest, scale=None, seqused_k=None):
        return varlen(q, k, v, cu_q, cu_k, max_q, max_k + 1, *rest, scale=scale,
                      seqused_k=seqused_k + 1)

    backend = CudaAttentionBackend(kv, "aten-flash", varlen_fn=over)
    run_scenario(kv, backend, STEPS, tol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_paged_backend_matches_reference_through_fork_and_copy_on_write(
        dtype: torch.dtype) -> None:
    if dtype == torch.float16 and not triton_required.USE:
        pytest.skip("triton is not installed (not a dependency here)")
    device = "cuda" if CUDA else "cpu"
    kv = paged_cache(dtype, device)
    backend = CudaAttentionBackend(kv, "triton" if dtype == torch.float16 else "sdpa")
    tol = 2e-2 if dtype == torch.float16 else 1e-4
    _, hist = run_scenario(kv, backend, STEPS[:3], tol=tol)
    assert kv.fork("b", "b2")  # b has 51 tokens: its partial last block is shared
    hist["b2"] = [list(kvs) for kvs in hist["b"]]
    steps = [{"b": 1, "b2": 1, "a": 1}, {"b2": 3, "c": 1}, {"b2": 1, "b": 1}]  # b copies
    run_scenario(kv, backend, steps, tol=tol, seed=1, hist=hist)  # CoW: b and b2 diverge
    assert kv.block_table("b")[:3] == kv.block_table("b2")[:3]
    assert kv.block_table("b")[3] != kv.block_table("b2")[3]
    for rid in kv.room.request_ids():  # the incremental numpy tables equal the manager's
        assert kv.tables.get(rid, 10**9).tolist() == kv.block_table(rid)
    kv.accounting.check()


@cpu_only  # plumbing
def test_paged_flash_attn_plumbing_uses_block_tables() -> None:
    kv = paged_cache(torch.bfloat16, block_size=256, num_blocks=8)
    fa = FakeFlashAttn()
    backend = CudaAttentionBackend(kv, "flash-attn", flash_attn=fa)
    run_scenario(kv, backend, STEPS, tol=2e-2)
    assert set(fa.calls) == {"paged"}


def test_virtual_step_arrays_are_exact() -> None:
    kv = host_virtual(torch.float16)
    backend = CudaAttentionBackend(kv, "sdpa")
    t = kv.layout.slot_tokens  # 512
    assert kv.allocate("x", 3) and kv.allocate("y", 5) and kv.allocate("z", 2)
    slots = [kv.slot(r) for r in "xyz"]
    step = backend.build_step(["y", "x", "z"], [4, 0, 1], [1, 3, 1])
    a = step.arrays
    sy, sx, sz = slots[1] * t, slots[0] * t, slots[2] * t
    assert a["write_rows"].tolist() == [sy + 4, sx, sx + 1, sx + 2, sz + 1]
    assert a["cu_seqlens_q"].tolist() == [0, 1, 4, 5]
    assert a["cu_seqlens_k"].tolist() == [sy, sx, sz, sz + 2]
    assert a["seq_lens"].tolist() == [5, 3, 2]
    assert a["slot_ids"].tolist() == [slots[1], slots[0], slots[2]]
    assert (step.max_query_len, step.max_seq_len, step.is_decode) == (3, 5, False)
    assert a["cu_seqlens_q"].dtype == np.int32 and a["write_rows"].dtype == np.int64
    meta = backend.prepare(["y", "x", "z"], [4, 0, 1], [1, 3, 1])
    assert meta.write_rows.tolist() == a["write_rows"].tolist()
    assert meta.cu_seqlens_k.dtype == torch.int32
    assert meta.addressing.sequence_rows(0, 5) == slice(sy, sy + 5)


def test_graph_padding_writes_nothing_and_reads_nothing() -> None:
    kv = host_virtual(torch.float16)
    backend = CudaAttentionBackend(kv, "sdpa")
    assert kv.allocate("x", 3) and kv.allocate("y", 1)
    step = backend.build_step(["x", "y"], [2, 0], [1, 1], pad_to=4)
    a = step.arrays
    t = kv.layout.slot_tokens
    assert a["write_rows"].tolist() == [kv.slot("x") * t + 2, kv.slot("y") * t, -1, -1]
    assert a["seq_lens"].tolist() == [3, 1, 0, 0]
    assert a["cu_seqlens_q"].tolist() == [0, 1, 2, 3, 4]
    assert (step.max_query_len, step.max_seq_len, step.num_padded) == (1, t, 2)
    static = backend.graph_step(4)  # what a graph is captured with: the same layout
    assert layout(static.arrays) == layout(a)
    assert static.arrays["write_rows"].tolist() == [-1] * 4
    with pytest.raises(ValueError, match="only decode batches"):
        backend.build_step(["x"], [0], [3], pad_to=4)
    with pytest.raises(ValueError, match="only decode batches"):
        backend.build_step(["x", "y"], [2, 0], [1, 1], pad_to=1)

    pkv = paged_cache(torch.float16)
    pb = CudaAttentionBackend(pkv, "triton" if triton_required.USE else "sdpa")
    assert pkv.allocate("x", 40) and pkv.allocate("y", 1)
    step = pb.build_step(["x", "y"], [39, 0], [1, 1], pad_to=3)
    bt = step.arrays["block_table"]
    assert bt.shape == (3, pkv.max_blocks) and bt[0, :3].tolist() == pkv.block_table("x")
    assert step.arrays["write_rows"].tolist() == [pkv.block_table("x")[2] * 16 + 7,
                                                  pkv.block_table("y")[0] * 16, -1]
    if pb.kernel != "sdpa":  # sdpa gathers per request: never captured
        assert layout(pb.graph_step(3).arrays) == layout(step.arrays)


def test_staging_packs_aligned_fields_in_one_copy() -> None:
    staging = StagingBuffer("cpu", capacity=64)
    arrays = {"a": np.arange(3, dtype=np.int64), "b": np.array([[1, 2], [3, 4]], np.int32),
              "c": np.zeros(0, np.int32), "d": np.array([7], np.int32)}
    fields, nbytes = layout(arrays)
    assert [f.offset for f in fields] == [0, 32, 48, 48] and nbytes == 64
    views = staging.pack(arrays)
    assert views["a"].tolist() == [0, 1, 2] and views["b"].tolist() == [[1, 2], [3, 4]]
    assert views["d"].tolist() == [7] and views["c"].numel() == 0
    assert staging.num_copies == 1
    big = {"x": np.arange(100, dtype=np.int64)}
    assert staging.pack(big)["x"].tolist() == list(range(100))  # grows
    dst = staging.device_buffer(nbytes)
    v1 = staging.pack(arrays, dst=dst)
    staging.pack({**arrays, "d": np.array([9], np.int32)}, dst=dst)
    assert v1["d"].tolist() == [9]  # same buffer, same offsets: old views see new values
    with pytest.raises(ValueError, match="dst must be"):
        staging.pack(big, dst=dst)


@needs_triton
def test_triton_store_skips_padding_rows() -> None:
    from vmkv.attention.kv_store import store_triton

    device = "cuda" if CUDA else "cpu"
    cache = torch.zeros(6, 3, 2, KV_HEADS, HEAD_DIM, device=device)  # [rows, L, k|v, H, D]
    k_flat, v_flat = cache[:, 1, 0], cache[:, 1, 1]  # strided, like the all-layers layout
    k = torch.randn(4, KV_HEADS, HEAD_DIM, device=device)
    v = torch.randn(4, KV_HEADS, HEAD_DIM, device=device)
    rows = torch.tensor([4, -1, 0, -1], device=device)
    store_triton(k_flat, v_flat, rows, k, v)
    assert torch.equal(k_flat[4], k[0]) and torch.equal(v_flat[0], v[2])
    written = torch.zeros_like(cache)
    written[4, 1, 0], written[0, 1, 0], written[4, 1, 1], written[0, 1, 1] = k[0], k[2], v[0], v[2]
    assert torch.equal(cache, written)  # nothing else touched (row -1 masked)
    ref = torch.zeros_like(cache)
    store_index_copy(ref[:, 1, 0], ref[:, 1, 1], rows, k, v)
    assert torch.equal(ref, cache)


def resolve_virtual_kernel(requested: str, dtype: torch.dtype, head_dim: int, **kw: bool
                           ) -> str:
    return resolve_kernel(requested, paged=False, dtype=dtype, head_dim=head_dim, block_size=0,
                          **kw)


def resolve_paged_kernel(requested: str, dtype: torch.dtype, head_dim: int, block_size: int, *,
                         flash_attn: bool, triton: bool) -> str:
    return resolve_kernel(requested, paged=True, dtype=dtype, head_dim=head_dim,
                          block_size=block_size, flash_attn=flash_attn, aten=True, triton=triton,
                          rows_fit_int32=True)


def test_kernel_choice(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
                       ) -> None:
    bf16, fp32 = torch.bfloat16, torch.float32
    ok = {"flash_attn": False, "aten": True, "triton": True, "rows_fit_int32": True}
    assert resolve_virtual_kernel("auto", bf16, 128, **ok) == "triton"
    assert resolve_virtual_kernel("auto", bf16, 128, **{**ok, "triton": False}) == "aten-flash"
    assert resolve_virtual_kernel("auto", bf16, 128, **{**ok, "flash_attn": True}) == "flash-attn"
    assert resolve_virtual_kernel("flash", bf16, 128, **ok) == "aten-flash"
    assert resolve_virtual_kernel("triton", bf16, 128, **ok) == "triton"
    with caplog.at_level(logging.WARNING):
        assert resolve_virtual_kernel("auto", fp32, 128, **ok) == "sdpa"
        assert resolve_virtual_kernel("aten-flash", fp32, 128, **ok) == "sdpa"
        assert resolve_virtual_kernel("auto", bf16, 72 + 4, **ok) == "triton"  # head_dim % 8
        assert resolve_virtual_kernel("auto", bf16, 128,
                                      **{**ok, "rows_fit_int32": False}) == "triton"
        assert resolve_virtual_kernel("auto", bf16, 72 + 4,
                                      **{**ok, "triton": False}) == "sdpa"
        assert resolve_virtual_kernel("auto", bf16, 128, **{**ok, "triton": False,
                                                            "rows_fit_int32": False}) == "sdpa"
    assert "float16/bfloat16 only" in caplog.text and "2**31" in caplog.text
    with pytest.raises(ValueError, match="needs the flash_attn package"):
        resolve_virtual_kernel("flash-attn", bf16, 128, **ok)
    with pytest.raises(ValueError, match="aten-flash"):
        resolve_virtual_kernel("aten-flash", bf16, 128, **{**ok, "aten": False})
    assert resolve_paged_kernel("auto", bf16, 128, 16, flash_attn=True, triton=True) == "triton"
    assert resolve_paged_kernel("auto", bf16, 128, 256, flash_attn=True, triton=True) == (
        "flash-attn")
    with pytest.raises(ValueError, match="% 256 == 0"):
        resolve_paged_kernel("flash-attn", bf16, 128, 16, flash_attn=True, triton=True)
    with pytest.raises(ValueError, match="no block table"):
        resolve_paged_kernel("aten-flash", bf16, 128, 256, flash_attn=False, triton=True)
    # the environment's choice arrives through the engine's config, never read here
    monkeypatch.setenv("VMKV_ATTENTION_BACKEND", "triton")
    assert EngineConfig().attention_backend == "triton"
    assert requested_kernel(None) == "auto" and requested_kernel("sdpa") == "sdpa"
    with pytest.raises(ValueError, match="attention kernel must be one of"):
        requested_kernel("fa9")
    monkeypatch.setenv("VMKV_ATTENTION_BACKEND", "fa9")
    with pytest.raises(ValueError, match=r"got 'fa9' \(from \$VMKV_ATTENTION_BACKEND\)"):
        EngineConfig()


def test_aten_op_schema_has_the_keywords_we_pass() -> None:
    kwargs = aten_flash_kwargs()
    assert {"scale", "seqused_k"} <= kwargs  # torch 2.11 and 2.13
    # torch 2.13 adds block_table and num_splits; 2.11 does not (documented in docs/gpu.md)
    if torch.__version__.startswith("2.11"):
        assert "block_table" not in kwargs


def test_factory_routes_by_device() -> None:
    kv = host_virtual(torch.float32)
    with pytest.raises(ValueError, match="CUDA attention kernel"):
        create_attention_backend(kv, "triton")
    assert create_attention_backend(kv).name.startswith("virtual")
    fake = SimpleNamespace(device=torch.device("meta"), kv_mode="virtual")
    with pytest.raises(ValueError, match="no attention backend"):
        create_attention_backend(fake)  # type: ignore[arg-type]


# -- GPU tests (real kernels; skipped without CUDA) ---------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["aten-flash", "triton"])
def test_gpu_virtual_backend_matches_fp32_reference(kernel: str) -> None:
    kv = cuda_virtual(torch.bfloat16)
    backend = CudaAttentionBackend(kv, kernel)
    assert backend.kernel == kernel
    errors, _ = run_scenario(kv, backend, boundary_steps(kv), tol=1e-2)
    torch.cuda.synchronize()
    assert max(errors) < 1e-2
    kv.close()


@pytest.mark.gpu
def test_gpu_paged_backend_matches_fp32_reference() -> None:
    kv = paged_cache(torch.bfloat16, "cuda", block_size=16, num_blocks=512)
    backend = CudaAttentionBackend(kv)
    assert backend.kernel == "triton"  # flash-attn is not installed there
    errors, _ = run_scenario(kv, backend, STEPS, tol=1e-2)
    assert max(errors) < 1e-2


@pytest.mark.gpu
def test_gpu_fp32_virtual_falls_back_to_sdpa() -> None:
    kv = cuda_virtual(torch.float32)
    backend = CudaAttentionBackend(kv)
    assert backend.kernel == "sdpa"
    run_scenario(kv, backend, STEPS, tol=1e-3)
    kv.close()
