"""Step 6: decode step time of a Llama-3-8B-shaped random-weight model (bf16), virtual vs
paged, eager vs CUDA graphs, against the memory roofline.

Each point (batch B, context C) holds B requests of C tokens (allocated round-robin 16 tokens
at a time, so paged blocks interleave as when requests grow together; the KV contents are
whatever the memory held: timing does not depend on them) and times one decode step: B new
tokens at position C-1, written to the same row every time (steady state at context C).

    roofline = (weights read + B * C * bytes/token of KV) / measured copy bandwidth

Weights are made on the GPU (no disk). ``VMKV_CHECK_DEVICE=cpu`` runs a tiny version on CPU
(dry run of this script). Points stop early when the step's time budget runs out.
"""

from __future__ import annotations

import os
import time

from common import (
    LLAMA3_8B,
    Result,
    copy_bandwidth,
    cuda_time_ms,
    guard,
    random_vmkv_model,
    run_step,
    tiny_llama_config,
)

DEVICE = os.environ.get("VMKV_CHECK_DEVICE", "cuda")
BUDGET_S = float(os.environ.get("VMKV_STEP_BUDGET", "100"))
POINTS = [(1, 16384), (16, 16384), (32, 8192), (64, 4096), (128, 2048), (256, 1024),
          (256, 2048)]
if DEVICE == "cpu":
    POINTS = [(1, 64), (4, 32)]


def fill(kv, rids: list[str], ctx: int, chunk: int = 16) -> None:  # type: ignore[no-untyped-def]
    for start in range(0, ctx, chunk):
        for rid in rids:
            if not kv.allocate(rid, min(chunk, ctx - start)):
                raise RuntimeError(f"KV budget too small at {rid} {start}")


def measure_point(kv, attn, model, mode: str, batch: int, ctx: int) -> dict:  # type: ignore[no-untyped-def]
    """Fill ``batch`` requests of ``ctx`` tokens, time one decode step eagerly and as a CUDA
    graph, free the requests."""
    import torch

    from vmkv.engine.cuda_graphs import DecodeGraphRunner

    rids = [f"{mode}-{batch}-{ctx}-{i}" for i in range(batch)]
    t_fill = time.monotonic()
    fill(kv, rids, ctx)
    row: dict = {"mode": mode, "batch": batch, "context": ctx,
                 "fill_s": time.monotonic() - t_fill}
    ctx_lens, qlens = [ctx - 1] * batch, [1] * batch
    ids = torch.ones(batch, dtype=torch.int64, device=DEVICE)
    pos = torch.full((batch,), ctx - 1, dtype=torch.int64, device=DEVICE)

    def eager() -> torch.Tensor:
        meta = attn.prepare(rids, ctx_lens, qlens)
        return model.compute_logits(model.forward(ids, pos, attn, meta))

    with torch.inference_mode():
        t = time.perf_counter()
        for _ in range(20):
            attn.prepare(rids, ctx_lens, qlens)
        row["prepare_host_ms"] = (time.perf_counter() - t) / 20 * 1e3
        if DEVICE == "cuda":
            row["eager_ms"] = cuda_time_ms(eager, warmup=2, iters=5)["median_ms"]
            graphs = DecodeGraphRunner(model, attn, max_batch_size=batch, batch_sizes=[batch])
            t = time.monotonic()
            graphs.capture()
            row["capture_s"] = time.monotonic() - t
            ones = [1] * batch
            row["graph_ms"] = cuda_time_ms(
                lambda: model.compute_logits(graphs.run(rids, ctx_lens, ones, ctx_lens)),
                warmup=2, iters=5)["median_ms"]
        else:
            t = time.perf_counter()
            eager()
            row["eager_ms"] = (time.perf_counter() - t) * 1e3
    for rid in rids:
        kv.free(rid)
    return row


def measure(res: Result, model, mcfg, mode: str, bw: float, weight_read: int,  # type: ignore[no-untyped-def]
            deadline: float) -> list[dict]:
    import torch

    from vmkv.attention import create_attention_backend
    from vmkv.config import CacheConfig
    from vmkv.kv import create_kv_cache

    spec = mcfg.kv_spec(torch.bfloat16)
    most = max(b * c for b, c in POINTS)
    budget = most * spec.bytes_per_token + 64 * (2 << 20)
    max_len = max(c for _, c in POINTS) + 16
    t0 = time.monotonic()
    kv = create_kv_cache(CacheConfig(kv_mode=mode, kv_cache_memory=budget, block_size=16),
                         spec, num_slots=max(b for b, _ in POINTS), max_model_len=max_len,
                         device=DEVICE)
    attn = create_attention_backend(kv)
    res.record(f"{mode}_setup", {"kernel": getattr(attn, "kernel", attn.name),
                                 "kv_build_s": time.monotonic() - t0})
    rows = []
    for batch, ctx in POINTS:
        if time.monotonic() > deadline:
            rows.append({"mode": mode, "batch": batch, "context": ctx, "skipped": "budget"})
            continue
        row = measure_point(kv, attn, model, mode, batch, ctx)
        kv_bytes = batch * ctx * spec.bytes_per_token
        roof_ms = (weight_read + kv_bytes) / bw * 1e3
        row.update(kv_gib=kv_bytes / 2**30, roofline_ms=roof_ms,
                   eager_vs_roofline=row["eager_ms"] / roof_ms)
        if "graph_ms" in row:
            row["graph_vs_roofline"] = row["graph_ms"] / roof_ms
        rows.append(row)
        res.record(f"{mode}_rows", rows)
        print(f"[s6_decode] {mode} B={batch} ctx={ctx}: eager {row['eager_ms']:.2f} ms, graph "
              f"{row.get('graph_ms', float('nan')):.2f} ms, roofline {roof_ms:.2f} ms",
              flush=True)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    if hasattr(kv, "backend"):
        res.record(f"{mode}_vmm_ops", kv.backend.stats.as_dict())
    kv.close()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return rows


def main(res: Result) -> None:
    import torch
    import transformers

    start = time.monotonic()
    bw = copy_bandwidth(4 << 30) if DEVICE == "cuda" else 50e9
    res.record("copy_bandwidth_tb_s", bw / 1e12)
    hf_cfg = (transformers.LlamaConfig(**LLAMA3_8B) if DEVICE == "cuda"
              else tiny_llama_config())
    t = time.monotonic()
    model, mcfg = random_vmkv_model(hf_cfg, torch.bfloat16, DEVICE)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.embed_tokens.weight
    weight_read = total - embed.numel() * embed.element_size()  # decode reads B rows of it
    res.record("model", {"params_gib": total / 2**30, "build_s": time.monotonic() - t,
                         "bytes_per_token_kv": mcfg.kv_spec(torch.bfloat16).bytes_per_token})
    deadline = start + BUDGET_S
    by_mode: dict[str, list[dict]] = {}
    for i, mode in enumerate(("virtual", "paged")):
        # leave the paged mode its share of the remaining budget
        mode_deadline = deadline if i else start + (BUDGET_S + (time.monotonic() - start)) / 2
        rows = guard(res, f"decode/{mode}", lambda m=mode, d=mode_deadline: measure(
            res, model, mcfg, m, bw, weight_read, d))
        by_mode[mode] = rows or []
    done = {(r["batch"], r["context"]): r for r in by_mode["virtual"] if "eager_ms" in r}
    ratios = []
    for r in by_mode["paged"]:
        v = done.get((r["batch"], r["context"]))
        if v is None or "eager_ms" not in r:
            continue
        key = "graph_ms" if "graph_ms" in r and "graph_ms" in v else "eager_ms"
        ratios.append({"batch": r["batch"], "context": r["context"], "timing": key,
                       "paged_over_virtual": r[key] / v[key]})
    res.record("paged_over_virtual", ratios)
    res.check("decode steps ran in both modes", bool(ratios), points=len(ratios))
    if ratios:
        best = min(ratios, key=lambda x: x["paged_over_virtual"])
        worst = max(ratios, key=lambda x: x["paged_over_virtual"])
        res.headline = (f"paged/virtual step time {best['paged_over_virtual']:.2f}-"
                        f"{worst['paged_over_virtual']:.2f}x over {len(ratios)} points")


if __name__ == "__main__":
    run_step("s6_decode", main)
