"""Step 6: decode step time of a Llama-3-8B-shaped random-weight model (bf16), virtual vs
paged, eager vs CUDA graphs, against the memory roofline.

Each point (batch B, context C) holds B requests of C tokens (allocated round-robin 16 tokens
at a time, so paged blocks interleave as when requests grow together; the KV contents are
whatever the memory held: timing does not depend on them) and times one decode step: B new
tokens at position C-1, written to the same row every time (steady state at context C).
Virtual and paged are measured point by point, and each point's paged/virtual ratio is
recorded as soon as both exist, so a timeout keeps every finished point.

    roofline = (weights read + B * C * bytes/token of KV) / measured copy bandwidth

Memory: weights ~15 GiB plus both caches sized for the largest point (2 x 32 GiB at 128 KiB of
KV per token), ~80 GiB in all; free memory is recorded after every point. Weights are made on
the GPU (no disk). ``VMKV_CHECK_DEVICE=cpu`` runs a tiny version on CPU (eager timings only).
Points stop when the step's time budget runs out; the most informative come first.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from common import (
    DEVICE,
    LLAMA3_8B,
    ON_CPU,
    Result,
    copy_bandwidth,
    guard,
    random_vmkv_model,
    run_step,
    step_budget,
    time_ms,
    tiny_llama_config,
)

BUDGET_S = step_budget(60)
#: KV-bound points first (32 GiB of KV each: where translation cost shows), then the extremes
#: (the largest is 32 GiB: weights + two caches of that size must fit the H200's 140 GiB)
POINTS = [(32, 8192), (128, 2048), (1, 16384), (256, 1024), (16, 16384), (64, 4096)]
if ON_CPU:
    POINTS = [(1, 64), (4, 32)]


def fill(kv, rids: list[str], ctx: int, chunk: int = 16) -> None:  # type: ignore[no-untyped-def]
    for start in range(0, ctx, chunk):
        for rid in rids:
            if not kv.allocate(rid, min(chunk, ctx - start)):
                raise RuntimeError(f"KV budget too small at {rid} {start}")


def measure_point(kv, attns, model, mode: str, batch: int, ctx: int) -> list[dict]:  # type: ignore[no-untyped-def]
    """Fill ``batch`` requests of ``ctx`` tokens, time one decode step eagerly and (on CUDA)
    as a CUDA graph with each backend of ``attns`` (one fill), free the requests."""
    rids = [f"{mode}-{batch}-{ctx}-{i}" for i in range(batch)]
    t_fill = time.monotonic()
    fill(kv, rids, ctx)
    fill_s = time.monotonic() - t_fill
    try:
        return [{"mode": mode, "kernel": getattr(attn, "kernel", attn.name), "batch": batch,
                 "context": ctx, "fill_s": fill_s, **time_step(attn, model, rids, ctx)}
                for attn in attns]
    finally:
        for rid in rids:
            kv.free(rid)


def time_step(attn, model, rids: list[str], ctx: int) -> dict:  # type: ignore[no-untyped-def]
    """One decode step at context ``ctx`` over the filled ``rids``: host prepare, eager and
    (on CUDA) CUDA-graph milliseconds."""
    import torch

    from vmkv.executor.cuda_graphs import DecodeGraphRunner

    batch = len(rids)
    ctx_lens, qlens = [ctx - 1] * batch, [1] * batch
    ids = torch.ones(batch, dtype=torch.int64, device=DEVICE)
    pos = torch.full((batch,), ctx - 1, dtype=torch.int64, device=DEVICE)

    def eager() -> torch.Tensor:
        meta = attn.prepare(rids, ctx_lens, qlens)
        return model.compute_logits(model.forward(ids, pos, attn, meta))

    row: dict = {}
    with torch.inference_mode():
        t = time.perf_counter()
        for _ in range(20):
            attn.prepare(rids, ctx_lens, qlens)
        row["prepare_host_ms"] = (time.perf_counter() - t) / 20 * 1e3
        row["eager_ms"] = time_ms(eager, warmup=2, iters=1 if ON_CPU else 5)["median_ms"]
        if not ON_CPU:
            graphs = DecodeGraphRunner(model, attn, max_batch_size=batch, batch_sizes=[batch])
            t = time.monotonic()
            graphs.capture()
            row["capture_s"] = time.monotonic() - t
            ones = [1] * batch  # input ids
            row["graph_ms"] = time_ms(
                lambda: model.compute_logits(graphs.run(rids, ctx_lens, ones, ctx_lens)),
                warmup=2, iters=5)["median_ms"]
    return row


def build_caches(res: Result, mcfg: Any) -> dict[str, tuple[Any, list[Any]]]:
    """One KV cache per mode, sized for the largest point, with its attention backends: the
    mode's default first; on CUDA, virtual also with aten-flash (FlashAttention-2 unmodified
    on the slot views) when that is not the default."""
    import torch

    from vmkv.attention import create_attention_backend
    from vmkv.config import CacheConfig
    from vmkv.kv import create_kv_cache

    spec = mcfg.kv_spec(torch.bfloat16)
    budget = max(b * c for b, c in POINTS) * spec.bytes_per_token + 64 * (2 << 20)
    out = {}
    for mode in ("virtual", "paged"):
        t0 = time.monotonic()
        kv = create_kv_cache(CacheConfig(kv_mode=mode, kv_cache_memory=budget, block_size=16),
                             spec, num_slots=max(b for b, _ in POINTS),
                             max_model_len=max(c for _, c in POINTS) + 16, device=DEVICE)
        attns = [create_attention_backend(kv)]
        if not ON_CPU and mode == "virtual" and attns[0].kernel != "aten-flash":
            try:
                attns.append(create_attention_backend(kv, "aten-flash"))
            except ValueError as exc:  # no aten FA2 with seqused_k in this torch
                res.record("virtual_aten_flash", f"not measured: {exc}")
        out[mode] = (kv, attns)
        res.record(f"{mode}_setup", {"kernel": getattr(attns[0], "kernel", attns[0].name),
                                     "also": [a.kernel for a in attns[1:]],
                                     "kv_build_s": time.monotonic() - t0,
                                     "kv_budget_gib": budget / 2**30})
    return out


def free_gib() -> float | str:
    import torch

    return "n/a on cpu" if ON_CPU else torch.cuda.mem_get_info()[0] / 2**30


def main(res: Result) -> None:
    import torch
    import transformers

    start = time.monotonic()
    deadline = start + BUDGET_S
    bw = 50e9 if ON_CPU else copy_bandwidth(4 << 30)
    res.record("copy_bandwidth_tb_s", bw / 1e12)
    hf_cfg = tiny_llama_config() if ON_CPU else transformers.LlamaConfig(**LLAMA3_8B)
    t = time.monotonic()
    model, mcfg = random_vmkv_model(hf_cfg, torch.bfloat16, DEVICE)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.embed_tokens.weight
    weight_read = total - embed.numel() * embed.element_size()  # decode reads B rows of it
    bytes_per_token = mcfg.kv_spec(torch.bfloat16).bytes_per_token
    res.record("model", {"params_gib": total / 2**30, "build_s": time.monotonic() - t,
                         "bytes_per_token_kv": bytes_per_token})
    caches = build_caches(res, mcfg)
    rows: list[dict] = []
    ratios: list[dict] = []
    for batch, ctx in POINTS:
        if time.monotonic() > deadline:
            rows.append({"batch": batch, "context": ctx, "skipped": "budget"})
            res.record("rows", rows)
            continue
        roof_ms = (weight_read + batch * ctx * bytes_per_token) / bw * 1e3
        point = {}
        for mode, (kv, attns) in caches.items():
            measured = guard(res, f"decode/{mode} B={batch} ctx={ctx}", functools.partial(
                measure_point, kv, attns, model, mode, batch, ctx))
            if not ON_CPU:
                torch.cuda.empty_cache()  # a failed point's graph pool too
            for row in measured or []:
                row.update(roofline_ms=roof_ms, eager_vs_roofline=row["eager_ms"] / roof_ms,
                           free_gib=free_gib())
                if "graph_ms" in row:
                    row["graph_vs_roofline"] = row["graph_ms"] / roof_ms
                point.setdefault(mode, row)  # the mode's default kernel: the ratio's side
                rows.append(row)
                res.record("rows", rows)
                print(f"[s6_decode] {mode}/{row['kernel']} B={batch} ctx={ctx}: eager "
                      f"{row['eager_ms']:.2f} ms, graph {row.get('graph_ms', float('nan')):.2f}"
                      f" ms, roofline {roof_ms:.2f} ms", flush=True)
        if len(point) == 2:
            v, p = point["virtual"], point["paged"]
            key = "graph_ms" if "graph_ms" in v and "graph_ms" in p else "eager_ms"
            ratios.append({"batch": batch, "context": ctx, "timing": key,
                           "paged_over_virtual": p[key] / v[key]})
            res.record("paged_over_virtual", ratios)
    for mode, (kv, _) in caches.items():
        if hasattr(kv, "backend"):
            res.record(f"{mode}_vmm_ops", kv.backend.stats.as_dict())
        kv.close()
    res.check("decode steps ran in both modes", bool(ratios), points=len(ratios))
    if ratios:
        best = min(ratios, key=lambda x: x["paged_over_virtual"])
        worst = max(ratios, key=lambda x: x["paged_over_virtual"])
        res.headline = (f"paged/virtual step time {best['paged_over_virtual']:.2f}-"
                        f"{worst['paged_over_virtual']:.2f}x over {len(ratios)} points")


if __name__ == "__main__":
    run_step("s6_decode", main)
