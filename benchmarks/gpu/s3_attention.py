"""Step 3: attention correctness on real VMM memory and CUDA graphs over VA views.

* the CUDA backends (aten FlashAttention-2 varlen + seqused_k, the Triton twins, the SDPA
  fallback) against a float32 reference through the scenarios of tests/attention_scenarios.py:
  mixed prefill chunks and decodes, GQA, rows past each length poisoned with NaN, and one
  request ending exactly on a 2 MiB page boundary so its next row is *unmapped*;
* Llama-3-8B attention shapes (32 q / 8 kv heads x 128, bf16) at long contexts;
* CUDA graphs captured over the VA views, pages mapped under them afterwards, replay = eager
  (tests/graph_scenarios.py).
A fault here is error 700 (illegal address): the step dies and the check script says so.

A CPU dry run drives the same scenarios over host caches (64 KiB pages, tails unmapped: an
over-read is SIGSEGV) in float16: aten-flash through the injected float32 reference (the real op
only checks shapes on meta tensors there), the Triton twins and the masked Triton K/V write
under the interpreter, small heads and contexts instead of 8B shapes, and the CPU graph double.
"""

from __future__ import annotations

from dataclasses import dataclass

from common import DEVICE, ON_CPU, Result, guard, memory_backend, run_step, sync, tests_on_path

tests_on_path()


@dataclass(frozen=True)
class Shapes:
    """Head counts, head size and request lengths of the long-context check."""

    heads: int
    kv_heads: int
    dim: int
    lens: dict[str, int]
    chunk: dict[str, int]  # the chunked-prefill step after one decode step of every request
    max_model_len: int


#: 8B heads; 4 KiB/token bf16: 512 tokens per 2 MiB page ("d", "e" end around a page boundary)
LLAMA8B = Shapes(32, 8, 128, {"a": 8192, "b": 1, "c": 3000, "d": 511, "e": 512, "f": 5000},
                 {"c": 512, "a": 1, "g": 700}, 16384)
#: dry run: 512 B/token fp16, 128 tokens per 64 KiB page
TINY = Shapes(4, 2, 64, {"a": 300, "b": 1, "c": 200, "d": 127, "e": 128, "f": 150},
              {"c": 40, "a": 1, "g": 70}, 1024)


def dtype():  # type: ignore[no-untyped-def]
    import torch

    return torch.float16 if ON_CPU else torch.bfloat16


def virtual_backend(kv, kernel: str | None = None):  # type: ignore[no-untyped-def]
    """The virtual CUDA backend as the check runs it: on a CPU dry run aten-flash is the
    injected reference and the Triton twin writes K/V with the (interpreted) Triton store."""
    from attention_scenarios import ReferenceVarlen

    from vmkv.attention.cuda import CudaAttentionBackend
    from vmkv.attention.kv_store import store_triton

    if not ON_CPU:
        return CudaAttentionBackend(kv, kernel)
    if kernel == "aten-flash":
        return CudaAttentionBackend(kv, kernel, varlen_fn=ReferenceVarlen())
    return CudaAttentionBackend(kv, kernel, store=store_triton if kernel == "triton" else None)


def long_context(shapes: Shapes, kernel: str) -> float:
    """A decode batch and a chunked prefill; returns the max relative error."""
    import attention_scenarios as sc
    import torch

    from vmkv.kv import KVSpec, VirtualKVCache
    from vmkv.memory import PagePool

    heads, kv_heads, dim = shapes.heads, shapes.kv_heads, shapes.dim
    dt = dtype()
    spec = KVSpec(1, kv_heads, dim, dt)
    backend = memory_backend(256)
    kv = VirtualKVCache(spec, pool=PagePool(backend, 256), num_slots=8,
                        max_model_len=shapes.max_model_len)
    attn = virtual_backend(kv, kernel)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    rand = lambda n, h: torch.randn(n, h, dim, generator=gen, device=DEVICE).to(dt)  # noqa: E731
    hist = {}
    for rid, n in shapes.lens.items():
        assert kv.allocate(rid, n)
        k, v = rand(n, kv_heads), rand(n, kv_heads)
        kf, vf = kv.layer_kv(0)
        kf[kv.slot(rid), :n], vf[kv.slot(rid), :n] = k, v
        hist[rid] = (k, v)
    worst = 0.0
    for step in ({r: 1 for r in shapes.lens}, shapes.chunk):
        rids = list(step)
        ctx = [kv.room.num_tokens(r) for r in rids]
        for rid, n in step.items():
            assert kv.allocate(rid, n)
        meta = attn.prepare(rids, ctx, [step[r] for r in rids])
        total = sum(step.values())
        q, k, v = rand(total, heads), rand(total, kv_heads), rand(total, kv_heads)
        out = attn.forward(0, q, k, v, meta, dim**-0.5).view(total, heads, dim)
        pos = 0
        for rid in rids:
            n = step[rid]
            old_k, old_v = hist.get(rid, (k[:0], v[:0]))
            hk = torch.cat([old_k, k[pos : pos + n]])
            hv = torch.cat([old_v, v[pos : pos + n]])
            hist[rid] = (hk, hv)
            ref = sc.attention_ref(q[pos : pos + n].float(), hk.float(), hv.float(), dim**-0.5)
            err = float((out[pos : pos + n].float() - ref).abs().max() / ref.abs().max())
            worst = max(worst, err)
            pos += n
    sync()
    kv.close()
    backend.close()
    return worst


def scenarios(res: Result, tol: float) -> None:
    """Every backend through the shared scenarios (tails unmapped, rows past lengths NaN)."""
    import attention_scenarios as sc
    import torch

    from vmkv.attention.cuda import CudaAttentionBackend
    from vmkv.attention.kv_store import store_triton

    def cache(dt):  # type: ignore[no-untyped-def]
        return sc.host_virtual(dt) if ON_CPU else sc.cuda_virtual(dt)

    for kernel in ("aten-flash", "triton"):
        def virtual(kernel: str = kernel) -> None:
            kv = cache(dtype())
            attn = virtual_backend(kv, kernel)
            steps = sc.STEPS if ON_CPU else sc.boundary_steps(kv)  # both end "c" on a page
            errors, _ = sc.run_scenario(kv, attn, steps, tol=tol)
            sync()
            res.check(f"virtual/{kernel} {dtype()} vs fp32 reference, tail unmapped",
                      max(errors) < tol, max_rel_err=max(errors), kernel=attn.kernel)
            kv.close()

        guard(res, f"virtual/{kernel}", virtual)

    def paged() -> None:
        if ON_CPU:
            kv = sc.paged_cache(dtype())
            attn = CudaAttentionBackend(kv, "triton", store=store_triton)
        else:
            kv = sc.paged_cache(dtype(), "cuda", block_size=16, num_blocks=512)
            attn = CudaAttentionBackend(kv)
        errors, _ = sc.run_scenario(kv, attn, sc.STEPS, tol=tol)
        res.check(f"paged/triton {dtype()} vs fp32 reference", max(errors) < tol,
                  max_rel_err=max(errors), kernel=attn.kernel)

    guard(res, "paged/triton", paged)

    def fp32() -> None:
        kv = cache(torch.float32)
        attn = virtual_backend(kv)
        errors, _ = sc.run_scenario(kv, attn, sc.STEPS, tol=1e-3)
        res.check("virtual fp32 falls back to SDPA and matches", attn.kernel == "sdpa",
                  max_rel_err=max(errors))
        kv.close()

    guard(res, "virtual/fp32", fp32)


def graphs(res: Result) -> None:
    """Decode graphs: replay = eager (CUDA graphs on the GPU, the CPU double in a dry run)."""
    import graph_scenarios as gs

    for case in ("virtual-aten-flash", "virtual-triton", "paged-triton"):
        def run(case: str = case) -> None:
            if ON_CPU:
                gs.cpu_replay(case)
            elif case.startswith("virtual"):
                gs.gpu_virtual_replay(case.removeprefix("virtual-"))
            else:
                gs.gpu_paged_replay()
            what = "CUDA graph over VA views" if case.startswith("virtual") else "CUDA graph"
            res.check(f"{what} ({case}): replay = eager while new pages are mapped", True)

        guard(res, f"graphs/{case}", run)


def main(res: Result) -> None:
    tol = 2e-2 if ON_CPU else 1e-2
    scenarios(res, tol)
    shapes = TINY if ON_CPU else LLAMA8B
    for kernel in ("aten-flash", "triton"):
        err = guard(res, f"long contexts {kernel}", lambda k=kernel: long_context(shapes, k))
        if err is not None:
            res.check(f"virtual/{kernel} at {shapes.heads}/{shapes.kv_heads} heads x "
                      f"{shapes.dim}, contexts to {max(shapes.lens.values())} (+chunked "
                      "prefill)", err < tol, max_rel_err=err)
    graphs(res)
    errs = [c.get("max_rel_err", 0) for c in res.checks if "max_rel_err" in c]
    res.headline = (f"{sum(c['ok'] for c in res.checks)}/{len(res.checks)} checks, "
                    f"max rel err {max(errs, default=float('nan')):.2e}")


if __name__ == "__main__":
    run_step("s3_attention", main)
