"""Step 11: sliding-window attention over a virtual KV cache whose pages behind the window
are gone (issue 55).

A model of two layers, one full and one sliding (window W), in the per-layer layout: requests
are prefilled, then decode and take a chunk, so that the sliding layer's regions unmap the
whole pages behind the window (2 MiB on the GPU: 8 KV heads x 128 in bf16 = 1,024 tokens a
page) while the full layer keeps every page. Each kernel (aten FlashAttention-2 with
``window_size_left``, the Triton twins with their ``window``) must match a float32 reference
that reads only the window; a read behind it is an unmapped address (error 700 on the GPU,
SIGSEGV in the dry run). The dry run uses host pages of 4 KiB (2 KV heads x 64 in fp16: 16
tokens a page), the Triton interpreter and, for aten-flash, a window-aware float32 stand-in.
"""

from __future__ import annotations

from common import DEVICE, ON_CPU, Result, guard, memory_backend, run_step, sync

HEADS, KV_HEADS, DIM, WINDOW = (4, 2, 64, 40) if ON_CPU else (32, 8, 128, 512)
LENS = {"a": 300, "b": 57, "c": 1} if ON_CPU else {"a": 5000, "b": 900, "c": 1}
CHUNK = {"b": 45} if ON_CPU else {"b": 700}


class WindowReference:
    """Dry-run stand-in for ``aten._flash_attention_forward`` with a left window: checks the
    call against the real op's schema on meta tensors, then attends in float32 reading only
    the window's rows (the rows before it are unmapped)."""

    def __call__(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal,  # type: ignore
                 return_debug_mask, *, scale=None, seqused_k=None, window_size_left=None,
                 window_size_right=None):
        import torch

        meta = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
                for t in (q, k, v, cu_q, cu_k, seqused_k)]
        torch.ops.aten._flash_attention_forward(
            *meta[:5], max_q, max_k, 0.0, True, False, scale=scale, seqused_k=meta[5],
            window_size_left=window_size_left, window_size_right=window_size_right)
        assert window_size_right == 0 and window_size_left is not None
        out = torch.zeros_like(q)
        cq, ck, used = cu_q.tolist(), cu_k.tolist(), seqused_k.tolist()
        for b in range(len(used)):
            n = cq[b + 1] - cq[b]
            first = max(0, used[b] - n - window_size_left)
            rows = slice(ck[b] + first, ck[b] + used[b])
            out[cq[b] : cq[b + 1]] = reference(q[cq[b] : cq[b + 1]], k[rows], v[rows],
                                               used[b] - n - first, scale,
                                               window_size_left + 1)
        return out, torch.empty(q.shape[1], q.shape[0]), torch.empty(2), torch.empty(()), None


def reference(q, k, v, context: int, scale: float, window: int):  # type: ignore[no-untyped-def]
    """float32 attention of ``q [n, H, D]`` at positions ``context ..`` over ``k, v`` (whose
    first row is position 0 of this view): position p sees ``p - window + 1 .. p``."""
    import torch

    n, heads, _ = q.shape
    group = heads // k.shape[1]
    kf = k.float().repeat_interleave(group, 1).transpose(0, 1)
    vf = v.float().repeat_interleave(group, 1).transpose(0, 1)
    scores = q.float().transpose(0, 1) @ kf.transpose(1, 2) * scale  # [H, n, L]
    key = torch.arange(k.shape[0], device=q.device)[None, :]
    pos = (context + torch.arange(n, device=q.device))[:, None]
    scores = scores.masked_fill(~((key <= pos) & (key > pos - window)), float("-inf"))
    return (scores.softmax(-1) @ vf).transpose(0, 1).to(q.dtype)


def case(kernel: str) -> tuple[float, int]:
    """Prefill, one decode step and a chunk through ``kernel`` on the sliding layer; returns
    (max relative error, pages the sliding regions gave back)."""
    import torch

    from vmkv.attention.cuda import CudaAttentionBackend
    from vmkv.attention.kv_store import store_triton
    from vmkv.kv import KVSpec, VirtualKVCache
    from vmkv.kv.spec import LayerGroup
    from vmkv.memory import PagePool

    dt = torch.float16 if ON_CPU else torch.bfloat16
    spec = KVSpec(2, KV_HEADS, DIM, dt, layer_groups=(LayerGroup((0,)), LayerGroup((1,),
                                                                                 WINDOW)))
    pages = 512 if ON_CPU else 64
    backend = memory_backend(pages, host_page_size=4096)
    kv = VirtualKVCache(spec, pool=PagePool(backend, pages), num_slots=4, max_model_len=8192,
                        layout="per-layer")
    if ON_CPU:
        attn = CudaAttentionBackend(kv, kernel, varlen_fn=WindowReference() if kernel ==
                                    "aten-flash" else None,
                                    store=store_triton if kernel == "triton" else None)
    else:
        attn = CudaAttentionBackend(kv, kernel)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    rand = lambda n, h: torch.randn(n, h, DIM, generator=gen, device=DEVICE).to(dt)  # noqa: E731
    hist = {}
    for rid, n in LENS.items():
        assert kv.allocate(rid, n)
        k, v = rand(n, KV_HEADS), rand(n, KV_HEADS)
        kf, vf = kv.layer_kv(1)
        kf[kv.slot(rid), :n], vf[kv.slot(rid), :n] = k, v
        hist[rid] = (k, v)
    worst, scale = 0.0, DIM**-0.5
    for step in ({r: 1 for r in LENS}, CHUNK):
        rids = list(step)
        ctx = [kv.room.num_tokens(r) for r in rids]
        for rid, n in step.items():
            assert kv.allocate(rid, n)  # the sliding regions give back what is behind
        meta = attn.prepare(rids, ctx, [step[r] for r in rids])
        total = sum(step.values())
        q, k, v = rand(total, HEADS), rand(total, KV_HEADS), rand(total, KV_HEADS)
        out = attn.forward(1, q, k, v, meta, scale).view(total, HEADS, DIM)
        pos = 0
        for rid, c in zip(rids, ctx, strict=True):
            n = step[rid]
            hk = torch.cat([hist[rid][0], k[pos : pos + n]])
            hv = torch.cat([hist[rid][1], v[pos : pos + n]])
            hist[rid] = (hk, hv)
            ref = reference(q[pos : pos + n], hk, hv, c, scale, WINDOW)
            err = float((out[pos : pos + n].float() - ref.float()).abs().max()
                        / ref.float().abs().max())
            worst = max(worst, err)
            pos += n
    sync()
    dropped = kv.slots.dropped[kv.slot("a")]
    kv.accounting.check()
    kv.close()
    return worst, dropped


def main(res: Result) -> None:
    tol = 2e-2
    for kernel in ("aten-flash", "triton"):
        got = guard(res, f"sliding window {kernel}", lambda k=kernel: case(k))
        if got is not None:
            err, dropped = got
            res.check(f"virtual/{kernel}: window {WINDOW}, pages behind it unmapped, vs fp32 "
                      "reference", err < tol and dropped > 0, max_rel_err=err,
                      pages_given_back=dropped)
    errs = [c.get("max_rel_err", 0) for c in res.checks if "max_rel_err" in c]
    res.headline = (f"{sum(c['ok'] for c in res.checks)}/{len(res.checks)} checks, "
                    f"max rel err {max(errs, default=float('nan')):.2e}")


if __name__ == "__main__":
    run_step("s11_sliding_window", main)
