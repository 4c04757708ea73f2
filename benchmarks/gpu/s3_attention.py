"""Step 3: attention correctness on real VMM memory and CUDA graphs over VA views.

* the CUDA backends (aten FlashAttention-2 varlen + seqused_k, the Triton twins, the SDPA
  fallback) against a float32 reference through the scenarios of tests/test_attention_cuda.py:
  mixed prefill chunks and decodes, GQA, rows past each length poisoned with NaN, and one
  request ending exactly on a 2 MiB page boundary so its next row is *unmapped*;
* Llama-3-8B attention shapes (32 q / 8 kv heads x 128, bf16) at long contexts;
* CUDA graphs captured over the VA views, pages mapped under them afterwards, replay = eager
  (tests/test_cuda_graphs.py's GPU functions).
A fault here is error 700 (illegal address): the step dies and the check script says so.
"""

from __future__ import annotations

import sys

from common import ROOT, Result, guard, run_step

sys.path.insert(0, str(ROOT / "tests"))


def long_context(res: Result, kernel: str) -> float:
    """Decode batch and a chunked prefill at 8B shapes; returns the max relative error."""
    import test_attention_cuda as ta
    import torch

    from vmkv.attention.virtual_cuda import VirtualCudaBackend
    from vmkv.kv import KVSpec, VirtualKVCache
    from vmkv.memory import PagePool
    from vmkv.memory.cuda import CudaMemoryBackend

    heads, kv_heads, dim = 32, 8, 128
    spec = KVSpec(1, kv_heads, dim, torch.bfloat16)  # 4 KiB/token: 512 tokens per page
    backend = CudaMemoryBackend(None, 256)
    kv = VirtualKVCache(spec, pool=PagePool(backend, 256), num_slots=8, max_model_len=16384)
    attn = VirtualCudaBackend(kv, kernel)
    gen = torch.Generator(device="cuda").manual_seed(0)
    lens = {"a": 8192, "b": 1, "c": 3000, "d": 511, "e": 512, "f": 5000}
    hist = {}
    for rid, n in lens.items():
        assert kv.allocate(rid, n)
        k = torch.randn(n, kv_heads, dim, generator=gen, device="cuda").to(torch.bfloat16)
        v = torch.randn(n, kv_heads, dim, generator=gen, device="cuda").to(torch.bfloat16)
        kf, vf = kv.layer_kv(0)
        kf[kv.slot(rid), :n], vf[kv.slot(rid), :n] = k, v
        hist[rid] = (k, v)
    worst = 0.0
    for step in ({r: 1 for r in lens}, {"c": 512, "a": 1, "g": 700}):
        rids = list(step)
        ctx = [kv.num_tokens(r) for r in rids]
        for rid, n in step.items():
            assert kv.allocate(rid, n)
        meta = attn.prepare(rids, ctx, [step[r] for r in rids])
        total = sum(step.values())
        q = torch.randn(total, heads, dim, generator=gen, device="cuda").to(torch.bfloat16)
        k = torch.randn(total, kv_heads, dim, generator=gen, device="cuda").to(torch.bfloat16)
        v = torch.randn(total, kv_heads, dim, generator=gen, device="cuda").to(torch.bfloat16)
        out = attn.forward(0, q, k, v, meta, dim**-0.5).view(total, heads, dim)
        pos = 0
        for rid in rids:
            n = step[rid]
            old_k, old_v = hist.get(rid, (k[:0], v[:0]))
            hk = torch.cat([old_k, k[pos : pos + n]])
            hv = torch.cat([old_v, v[pos : pos + n]])
            hist[rid] = (hk, hv)
            ref = ta.attention_ref(q[pos : pos + n].float(), hk.float(), hv.float(), dim**-0.5)
            err = float((out[pos : pos + n].float() - ref).abs().max() / ref.abs().max())
            worst = max(worst, err)
            pos += n
    torch.cuda.synchronize()
    kv.close()
    backend.close()
    return worst


def main(res: Result) -> None:
    import test_attention_cuda as ta
    import test_cuda_graphs as tg
    import torch

    from vmkv.attention.paged_cuda import PagedCudaBackend
    from vmkv.attention.virtual_cuda import VirtualCudaBackend

    for kernel in ("aten-flash", "triton"):
        def virtual(kernel: str = kernel) -> None:
            kv = ta.cuda_virtual(torch.bfloat16)
            attn = VirtualCudaBackend(kv, kernel)
            errors, _ = ta.run_scenario(kv, attn, ta.gpu_steps(kv), tol=1e-2)
            torch.cuda.synchronize()
            res.check(f"virtual/{kernel} bf16 vs fp32 reference, tail unmapped",
                      max(errors) < 1e-2, max_rel_err=max(errors), kernel=attn.kernel)
            kv.close()

        guard(res, f"virtual/{kernel}", virtual)

    def paged() -> None:
        kv = ta.paged_cache(torch.bfloat16, "cuda", block_size=16, num_blocks=512)
        attn = PagedCudaBackend(kv)
        errors, _ = ta.run_scenario(kv, attn, ta.STEPS, tol=1e-2)
        res.check("paged/triton bf16 vs fp32 reference", max(errors) < 1e-2,
                  max_rel_err=max(errors), kernel=attn.kernel)

    guard(res, "paged/triton", paged)

    def fp32() -> None:
        kv = ta.cuda_virtual(torch.float32)
        attn = VirtualCudaBackend(kv)
        errors, _ = ta.run_scenario(kv, attn, ta.STEPS, tol=1e-3)
        res.check("virtual fp32 falls back to SDPA and matches", attn.kernel == "sdpa",
                  max_rel_err=max(errors))
        kv.close()

    guard(res, "virtual/fp32", fp32)

    for kernel in ("aten-flash", "triton"):
        err = guard(res, f"8B shapes {kernel}", lambda kernel=kernel: long_context(res, kernel))
        if err is not None:
            res.check(f"virtual/{kernel} at 8B head shapes, contexts to 8K (+chunked prefill)",
                      err < 1e-2, max_rel_err=err)

    for kernel in ("aten-flash", "triton"):
        def graphs(kernel: str = kernel) -> None:
            tg.test_gpu_graphs_virtual_replay_equals_eager_while_pages_are_mapped(kernel)
            res.check(f"CUDA graph over VA views ({kernel}): replay = eager while new pages "
                      "are mapped", True)

        guard(res, f"graphs/{kernel}", graphs)

    def paged_graphs() -> None:
        tg.test_gpu_graphs_paged_replay_equals_eager()
        res.check("CUDA graph, paged/triton: replay = eager", True)

    guard(res, "graphs/paged", paged_graphs)
    errs = [c.get("max_rel_err", 0) for c in res.checks if "max_rel_err" in c]
    res.headline = (f"{sum(c['ok'] for c in res.checks)}/{len(res.checks)} checks, "
                    f"max rel err {max(errs, default=float('nan')):.2e}")


if __name__ == "__main__":
    run_step("s3_attention", main)
