"""Attention scenarios shared by the tests and the GPU check (no pytest: the GPU image may lack it).

A scenario drives an attention backend through a few steps of mixed prefill chunks and decodes
over a real KV cache and compares every layer's output with a float32 reference implementing
FlashAttention-2's documented semantics. Rows a correct kernel never reads hold NaN (mapped rows
past each length) or are unmapped (host: SIGSEGV; CUDA: illegal address), so an over-read fails.

Used by ``tests/test_attention_cuda.py``, ``tests/test_cuda_graphs.py`` and the GPU check's
steps 3 and 9 (``benchmarks/gpu/``). Importing it without CUDA sets ``TRITON_INTERPRET=1``
before vmkv's Triton kernels are decorated, so they run interpreted on CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when Triton kernels are decorated (import)

from vmkv.kv import KVSpec, PagedKVCache, VirtualKVCache  # noqa: E402
from vmkv.memory import PagePool  # noqa: E402
from vmkv.memory.host import HostMemoryBackend  # noqa: E402

TESTS = str(Path(__file__).resolve().parent)
HEADS, KV_HEADS, HEAD_DIM, LAYERS = 4, 2, 64, 2
SCALE = HEAD_DIM**-0.5


# -- reference attention ------------------------------------------------------------------------
def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                  ) -> torch.Tensor:
    """float32 FA2 semantics: ``q [n, Hq, D]`` over ``k, v [L, Hkv, D]``, causal aligned
    bottom-right (query j sees keys ``0 .. L - n + j``); zeros when ``L == 0``."""
    n, heads, _ = q.shape
    if k.shape[0] == 0:
        return torch.zeros_like(q)
    group = heads // k.shape[1]
    kf = k.float().repeat_interleave(group, 1).transpose(0, 1)  # [Hq, L, D]
    vf = v.float().repeat_interleave(group, 1).transpose(0, 1)
    scores = q.float().transpose(0, 1) @ kf.transpose(1, 2) * scale  # [Hq, n, L]
    length = k.shape[0]
    visible = torch.arange(length)[None, :] <= (length - n + torch.arange(n))[:, None]
    scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
    return (scores.softmax(-1) @ vf).transpose(0, 1).to(q.dtype)  # [n, Hq, D]


class ReferenceVarlen:
    """Stand-in for ``aten._flash_attention_forward`` (same signature; tests only): checks
    the call on meta tensors with the real op's schema, then computes the float32 reference."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal,
                 return_debug_mask, *, scale=None, seqused_k=None):
        assert dropout_p == 0.0 and is_causal and not return_debug_mask
        assert cu_q.dtype == cu_k.dtype == seqused_k.dtype == torch.int32
        assert cu_q.is_contiguous() and cu_k.is_contiguous() and seqused_k.is_contiguous()
        assert k.stride(-1) == 1 and q.stride(-1) == 1
        meta = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
                for t in (q, k, v, cu_q, cu_k, seqused_k)]
        res = torch.ops.aten._flash_attention_forward(
            *meta[:5], max_q, max_k, 0.0, True, False, scale=scale, seqused_k=meta[5])
        assert tuple(res[0].shape) == tuple(q.shape) and res[0].dtype == q.dtype
        cq, ck, used = cu_q.tolist(), cu_k.tolist(), seqused_k.tolist()
        qlens = [b - a for a, b in zip(cq[:-1], cq[1:], strict=True)]
        assert max(qlens) <= max_q and max(used) <= max_k
        self.calls.append({"max_q": max_q, "max_k": max_k, "batch": len(used)})
        out = torch.zeros_like(q)
        for b in range(len(qlens)):
            rows = slice(ck[b], ck[b] + used[b])
            out[cq[b] : cq[b + 1]] = attention_ref(q[cq[b] : cq[b + 1]], k[rows], v[rows], scale)
        return out, torch.empty(q.shape[1], q.shape[0]), torch.empty(2), torch.empty(()), None


class FakeFlashAttn:
    """Stand-in for the ``flash_attn`` package (tests only): ``flash_attn_with_kvcache`` as
    documented in flash-attn 2.8 (slot selection by ``cache_batch_idx``, paged by
    ``block_table`` with block size % 256 == 0), computed by the float32 reference."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def flash_attn_with_kvcache(self, q, k_cache, v_cache, k=None, v=None, cache_seqlens=None,
                                cache_batch_idx=None, block_table=None, softmax_scale=None,
                                causal=False, **kw):
        assert k is None and v is None and causal
        assert cache_seqlens.dtype == torch.int32
        batch, n = q.shape[:2]
        out = torch.empty_like(q)
        for b in range(batch):
            length = int(cache_seqlens[b])
            if block_table is not None:
                bs = k_cache.shape[1]
                assert bs % 256 == 0 and block_table.dtype == torch.int32
                blocks = block_table[b, : -(-length // bs)].long()
                kb = k_cache[blocks].flatten(0, 1)[:length]
                vb = v_cache[blocks].flatten(0, 1)[:length]
                self.calls.append("paged")
            else:
                idx = int(cache_batch_idx[b]) if cache_batch_idx is not None else b
                kb, vb = k_cache[idx, :length], v_cache[idx, :length]
                self.calls.append("slots")
            out[b] = attention_ref(q[b], kb, vb, softmax_scale)
        return out


# -- scenarios: a few steps of mixed prefill chunks and decodes ----------------------------------
#: per step: {request: new tokens}; "c" ends exactly on a 64-token page boundary (host pages)
STEPS = [
    {"a": 37, "b": 20},
    {"a": 1, "b": 30, "c": 63},
    {"a": 1, "b": 1, "c": 1},
    {"b": 1, "c": 1, "a": 1},
    {"d": 5, "a": 1},
]


def host_virtual(dtype: torch.dtype, slots: int = 4, page: int = 64 * 1024) -> VirtualKVCache:
    """A virtual cache on host memory (real mmap, ``page``-byte pages, tails unmapped)."""
    spec = KVSpec(LAYERS, KV_HEADS, HEAD_DIM, dtype)  # fp16: 1 KiB/token, 64 tokens per page
    pool = PagePool(HostMemoryBackend(page, 64), 64)
    return VirtualKVCache(spec, pool=pool, num_slots=slots, max_model_len=512)


def paged_cache(dtype: torch.dtype, device: str = "cpu", block_size: int = 16,
                num_blocks: int = 64) -> PagedKVCache:
    """A paged cache with the scenario's KV shape on ``device``."""
    spec = KVSpec(LAYERS, KV_HEADS, HEAD_DIM, dtype)
    return PagedKVCache(spec, num_blocks=num_blocks, block_size=block_size, max_model_len=1024,
                        device=device)


def poison(kv: Any, lens: dict[str, int]) -> None:
    """NaN in every cache row a correct kernel never reads: mapped rows past each length
    (virtual; unmapped pages stay unmapped) or every row not holding live tokens (paged). A
    quantized cache's bytes are set to 0xFF: NaN as an fp8 value and as a float16 scale."""
    nan = float("nan")
    for layer in range(LAYERS):
        k, v = kv.layer_kv(layer)
        if kv.spec.quantized:
            k, v, nan = k.view(torch.uint8), v.view(torch.uint8), 0xFF
        if isinstance(kv, VirtualKVCache):
            for rid, n in lens.items():
                slot = kv.slot(rid)
                cap = kv.layout.tokens_in(kv.mapped_pages(slot))
                k[slot, n:cap] = nan
                v[slot, n:cap] = nan
        else:
            live = torch.zeros(k.shape[0] * k.shape[1], dtype=torch.bool)
            for rid, n in lens.items():
                table = torch.tensor(kv.block_table(rid))
                pos = torch.arange(n)
                live[table[pos // kv.block_size] * kv.block_size + pos % kv.block_size] = True
            k.flatten(0, 1)[~live.to(k.device)] = nan
            v.flatten(0, 1)[~live.to(v.device)] = nan


History = dict[str, list[list[torch.Tensor]]]  # request -> layer -> [k, v] float32 rows


def run_scenario(kv: Any, backend: Any, steps: list[dict[str, int]], *, tol: float,
                 seed: int = 0, hist: History | None = None) -> tuple[list[float], History]:
    """Drive ``backend`` through ``steps``; after every step each layer's output must match the
    reference over the K/V history ``hist`` (kept up to date). Returns the relative errors. A
    quantized cache (fp8 rows) takes float16 activations, and its rows are not compared with
    the history byte for byte (they hold the quantized values: tests/test_triton_fp8.py)."""
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float16 if kv.spec.quantized else kv.spec.dtype
    device = kv.device
    hist = {} if hist is None else hist
    errors = []
    for step in steps:
        rids = list(step)
        ctx = [kv.room.num_tokens(r) for r in rids]
        lens = {r: kv.room.num_tokens(r) for r in kv.room.request_ids()}  # every live request
        for rid, n in step.items():
            assert kv.allocate(rid, n)
        lens.update(zip(rids, ctx, strict=True))
        poison(kv, lens)
        meta = backend.prepare(rids, ctx, [step[r] for r in rids])
        total = sum(step.values())
        for layer in range(LAYERS):
            q, k, v = (torch.randn(total, h, HEAD_DIM, generator=gen).to(dtype)
                       for h in (HEADS, KV_HEADS, KV_HEADS))
            out = backend.forward(layer, q.to(device), k.to(device), v.to(device), meta, SCALE)
            assert out.shape == (total, HEADS * HEAD_DIM)
            pos = 0
            for rid in rids:
                n = step[rid]
                kh, vh = hist.setdefault(rid, [[torch.empty(0, KV_HEADS, HEAD_DIM)] * 2
                                               for _ in range(LAYERS)])[layer]
                kh = torch.cat([kh, k[pos : pos + n].float()])
                vh = torch.cat([vh, v[pos : pos + n].float()])
                hist[rid][layer] = [kh, vh]
                ref = attention_ref(q[pos : pos + n].float(), kh, vh, SCALE)
                got = out[pos : pos + n].float().cpu().view(n, HEADS, HEAD_DIM)
                assert torch.isfinite(got).all(), f"NaN in {rid}: a row past its length was read"
                err = float((got - ref).abs().max() / ref.abs().max())
                assert err < tol, (rid, layer, err)
                errors.append(err)
                pos += n
    for rid in list(hist) if not kv.spec.quantized else ():  # exactly what was written
        n = kv.room.num_tokens(rid)
        for layer in range(LAYERS):
            k, _ = kv.layer_kv(layer)
            if isinstance(kv, VirtualKVCache):
                stored = k[kv.slot(rid), :n]
            else:
                table = torch.tensor(kv.block_table(rid), device=k.device)
                stored = k[table].flatten(0, 1)[:n]
            torch.testing.assert_close(stored.float().cpu(), hist[rid][layer][0], atol=0, rtol=0)
    return errors, hist


# -- CUDA caches ------------------------------------------------------------------------------
def cuda_virtual(dtype: torch.dtype, slots: int = 4) -> VirtualKVCache:
    """A virtual cache on CUDA VMM (2 MiB pages) with the scenario's KV shape."""
    from vmkv.memory.cuda import CudaMemoryBackend

    spec = KVSpec(LAYERS, KV_HEADS, HEAD_DIM, dtype)
    backend = CudaMemoryBackend(None, 32)
    return VirtualKVCache(spec, pool=PagePool(backend, 32), num_slots=slots, max_model_len=8192)


def boundary_steps(kv: VirtualKVCache) -> list[dict[str, int]]:
    """Steps where request "c" ends exactly on a page boundary (2 MiB on CUDA): its next row is
    unmapped, so a one-row over-read faults (illegal address, SIGSEGV on the host) instead of
    passing silently."""
    per_page = kv.layout.tokens_in(1)
    return [{"a": 300, "c": per_page - 40}, {"a": 1, "c": 39, "b": 17},
            {"a": 1, "b": 1, "c": 1}, {"c": 1, "b": 1}, {"d": per_page, "a": 1}]


def run_child(module: str, func: str, *args: Any) -> subprocess.CompletedProcess:
    """Run ``module.func(*args)`` (a module in ``tests/``) in a child process with
    ``TRITON_INTERPRET=1`` (a fault there is a return code, not a dead test run; pytest's
    tracebacks would also print VA-backed tensors, touching unmapped pages)."""
    code = (f"import sys; sys.path.insert(0, {TESTS!r}); import {module} as t; "
            f"t.{func}(*{args!r})")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=900, env=env)
