"""``vmkv bench kernels``: attention alone, virtual slots vs block tables, per layer.

CPU (always): the engine's own backends over real KV managers built by
:func:`~vmkv.kv.create_kv_cache` (virtual: host pages mapped into slots; paged: a block pool),
with the default model's KV shape (30 layers, 3 KV heads x 64, float32), timing
``backend.forward`` of one layer (write the new K/V rows, then attend). Phases:

    decode        what the engine runs: the batched C++ decode kernel reading slot rows
                  (virtual) or block-table rows (paged) in place, when it is built
    decode-sdpa   the same decodes with the kernel switched off: SDPA per request on its
                  strided ``[slot, :len]`` view (virtual) vs one ``index_select`` gather by
                  block table, then SDPA (paged)
    prefill       a chunk per request: SDPA on the slot view vs gather + SDPA

Blocks are handed out round-robin, one block per request at a time, so each request's blocks
interleave as they do when requests grow together. Decode: one new token per request after
``context - 1`` cached; prefill: a chunk of ``prefill_len`` new tokens after ``context -
prefill_len``. ``--kv-cache-dtype float32,bfloat16,int8`` times each KV dtype (int8: rows
quantised by the engine's store, q and the new rows in bfloat16 where the CPU has it, else
float32; column ``kv_dtype``). ``prepare`` (once per step, shared by all layers) is timed on
its own. Both modes are timed alternately; each figure is the median of ``repeats`` runs after
``warmup`` runs.

CUDA (when available): the Triton twins, see :mod:`vmkv.bench.kernels_cuda`.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import torch

from vmkv.attention import create_attention_backend
from vmkv.bench.common import NUM_HEADS, progress_bar
from vmkv.bench.memory import SMOLLM2_135M
from vmkv.bench.timing import call_ms
from vmkv.config import HOST_PAGE_SIZE, CacheConfig
from vmkv.kv import KVCacheManager, KVSpec, create_kv_cache
from vmkv.kv.spec import kv_storage_dtype

PHASES = ("decode", "decode-sdpa", "prefill")


def _managers(spec: KVSpec, batch: int, context: int, layout: str, block_size: int,
              page_size: int | None = None) -> dict[str, KVCacheManager]:
    # + a part-filled virtual page per slot and layer (a page maps whole tokens: an int8 row of
    # 198 bytes fills 82 tokens of a 16 KiB page, so 512 tokens take 7 pages)
    page = page_size or HOST_PAGE_SIZE[layout]
    room = (batch * (context + 2 * block_size) * spec.bytes_per_token
            + batch * spec.num_layers * page + (8 << 20))
    out: dict[str, KVCacheManager] = {}
    for mode in ("virtual", "paged"):
        cache = CacheConfig(kv_mode=mode, kv_cache_memory=room, kv_layout=layout,
                            block_size=block_size, page_size=page_size)
        kv = create_kv_cache(cache, spec, num_slots=batch, max_model_len=context)
        for start in range(0, context, block_size):  # grow together: blocks interleave
            for i in range(batch):
                if not kv.allocate(f"r{i}", min(block_size, context - start)):
                    raise RuntimeError(f"{mode}: the pool was sized to fit")
        out[mode] = kv
    return out


def compute_dtype(kv_dtype: torch.dtype) -> torch.dtype:
    """The dtype of q and the new rows against a ``kv_dtype`` cache: its own, or for int8
    bfloat16 where the CPU has bfloat16 hardware (else float32)."""
    if kv_dtype != torch.int8:
        return kv_dtype
    from vmkv.cpu_info import bf16_hardware

    return torch.bfloat16 if bf16_hardware() else torch.float32


def _fill(kv: KVCacheManager, backend: Any, batch: int, context: int, seed: int) -> None:
    """Random K/V in every request's rows of layer 0 (commits the memory being read; an int8
    cache through the backend's quantising write)."""
    ids = [f"r{i}" for i in range(batch)]
    meta = backend.prepare(ids, [0] * batch, [context] * batch)
    gen = torch.Generator().manual_seed(seed)
    spec = kv.spec
    k, v = (torch.randn(len(meta.write_rows), spec.num_kv_heads, spec.head_dim, generator=gen,
                        dtype=compute_dtype(spec.dtype)) for _ in range(2))
    backend.write_kv(0, k, v, meta)


def measure_point(spec: KVSpec, batch: int, context: int, phase: str, *, prefill_len: int,
                  layout: str, block_size: int, repeats: int, warmup: int, seed: int = 0,
                  page_size: int | None = None) -> dict[str, Any]:
    """Median ms per layer of both modes at one (batch, context, phase); ``page_size`` is the
    virtual page (None: the layout's host default)."""
    query = min(prefill_len, context) if phase == "prefill" else 1
    kvs = _managers(spec, batch, context, layout, block_size, page_size)
    try:
        backends = {m: create_attention_backend(kv) for m, kv in kvs.items()}
        kernel = all(getattr(b, "batched_decode", False) for b in backends.values())
        if phase == "decode-sdpa":
            for b in backends.values():
                b.batched_decode = False  # the backends' switch for the batched kernel
        for m, kv in kvs.items():
            _fill(kv, backends[m], batch, context, seed)
        ids = [f"r{i}" for i in range(batch)]
        ctx, qlens = [context - query] * batch, [query] * batch
        metas = {m: b.prepare(ids, ctx, qlens) for m, b in backends.items()}
        gen = torch.Generator().manual_seed(seed + 1)
        dtype = compute_dtype(spec.dtype)
        q = torch.randn(batch * query, NUM_HEADS, spec.head_dim, generator=gen, dtype=dtype)
        k = torch.randn(batch * query, spec.num_kv_heads, spec.head_dim, generator=gen,
                        dtype=dtype)
        v = torch.randn(batch * query, spec.num_kv_heads, spec.head_dim, generator=gen,
                        dtype=dtype)
        scale = spec.head_dim**-0.5
        times: dict[str, list[float]] = {m: [] for m in kvs}
        prep: dict[str, list[float]] = {m: [] for m in kvs}
        for rep in range(warmup + repeats):
            for m in ("virtual", "paged") if rep % 2 == 0 else ("paged", "virtual"):
                b, meta = backends[m], metas[m]
                fwd = call_ms(lambda b=b, meta=meta: b.forward(0, q, k, v, meta, scale))
                pre = call_ms(lambda b=b: b.prepare(ids, ctx, qlens))
                if rep >= warmup:
                    times[m].append(fwd)
                    prep[m].append(pre)
    finally:
        for kv in kvs.values():
            kv.close()
    row: dict[str, Any] = {"device": "cpu", "kv_dtype": str(spec.dtype).removeprefix("torch."),
                           "phase": phase, "batch": batch, "context": context,
                           "query_len": query,
                           "decode_kernel": kernel and phase == "decode"}
    for m in kvs:
        row[f"{m}_ms"] = statistics.median(times[m])
        row[f"{m}_prepare_ms"] = statistics.median(prep[m])
    row["ratio"] = row["paged_ms"] / row["virtual_ms"]
    return row


def run(batch_sizes: Sequence[int] = (1, 8, 32), context_lens: Sequence[int] = (256, 1024, 4096),
        *, phases: Sequence[str] = PHASES, prefill_len: int = 256,
        layout: str = "all-layers", block_size: int = 16, page_size: int | None = None,
        repeats: int = 20, warmup: int = 3, max_tokens: int = 32768,
        shape: tuple[int, int, int] = SMOLLM2_135M, cuda: bool = True,
        progress: bool = True, kv_dtypes: Sequence[str] = ("float32",)) -> dict[str, Any]:
    """Every (phase, batch, context) point with ``batch * context <= max_tokens`` (the CPU
    holds that many tokens of all 30 layers per mode); CUDA points too when a GPU exists."""
    for name, values in (("batch_sizes", batch_sizes), ("context_lens", context_lens)):
        if not values or min(values) <= 0:
            raise ValueError(f"{name} must be positive integers, got {list(values)}")
    if repeats <= 0 or warmup < 0:
        raise ValueError(f"repeats must be > 0 and warmup >= 0, got {repeats}, {warmup}")
    bad = set(phases) - set(PHASES)
    if bad:
        raise ValueError(f"phases must be among {PHASES}, got {sorted(bad)}")
    specs = [KVSpec(*shape, dtype=kv_storage_dtype(name)) for name in kv_dtypes]
    points = [(s, p, b, c) for p in phases for b in batch_sizes for c in context_lens
              for s in specs if b * c <= max_tokens]
    skipped = [f"batch {b} x context {c}" for b in batch_sizes for c in context_lens
               if b * c > max_tokens]
    bar = progress_bar(progress, "kernels", iterable=points, unit="point")
    rows = []
    for spec, phase, batch, context in bar:
        rows.append(measure_point(spec, batch, context, phase, prefill_len=prefill_len,
                                  layout=layout, block_size=block_size, repeats=repeats,
                                  warmup=warmup, page_size=page_size))
    result: dict[str, Any] = {
        "kv_shape": {"layers": shape[0], "kv_heads": shape[1], "head_dim": shape[2],
                     "num_heads": NUM_HEADS, "dtype": ",".join(kv_dtypes)},
        "layout": layout, "block_size": block_size, "page_size": page_size,
        "prefill_len": prefill_len,
        "repeats": repeats, "warmup": warmup, "skipped": skipped, "rows": rows,
    }
    if cuda and torch.cuda.is_available():
        from vmkv.bench import kernels_cuda

        cuda_phases = [p for p in phases if p != "decode-sdpa"]
        result["rows"] += kernels_cuda.run(batch_sizes, context_lens, phases=cuda_phases,
                                           prefill_len=prefill_len, shape=shape,
                                           repeats=repeats, warmup=warmup)
    return result


COLUMNS = ("device", "kv_dtype", "phase", "batch", "context", "query_len", "virtual_ms", "paged_ms",
           "identity_ms", "shuffled_ms", "ratio", "virtual_prepare_ms", "paged_prepare_ms")
