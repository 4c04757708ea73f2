"""Step 7: translation cost at Llama-3-8B attention shapes (32 q / 8 kv heads x 128, bf16).

The same K/V read three ways by one kernel body (gpu.md §5.5): contiguous slot addressing
(virtual), a block table that is the identity over the same buffer (pure indirection), and a
shuffled block pool (indirection + locality). Both twin pairs: the Triton twins
(vmkv/kernels/triton_decode.py) and the PagedAttention-style CUDA twins
(vmkv/kernels/cuda_twins.py, built with nvcc here). Each point checks the outputs agree.
The K/V buffer is ``[slot, token, 2 layers, k|v, H, D]`` so the virtual view is strided like
the all-layers layout (token stride 2*2*8*128 elements).

The step's time budget starts before the nvcc build. A CPU dry run builds and loads the CUDA
twins' library the same way (for sm_90; launching it needs a GPU) and runs the Triton twins
under the interpreter at small heads and contexts in float16.
"""

from __future__ import annotations

import functools
import shutil
import time

from common import DEVICE, NA_CPU, ON_CPU, Result, guard, run_step, step_budget, time_ms

BUDGET_S = step_budget(40)
HEADS, KV_HEADS, DIM = (4, 2, 64) if ON_CPU else (32, 8, 128)
POINTS = [(1, 1024, 16), (1, 16384, 16), (32, 1024, 16), (32, 8192, 16), (32, 8192, 256),
          (128, 2048, 16), (128, 8192, 16)]
if ON_CPU:
    POINTS = [(1, 64, 16), (2, 48, 16)]


def dtype():  # type: ignore[no-untyped-def]
    import torch

    return torch.float16 if ON_CPU else torch.bfloat16


def layouts(batch: int, context: int, block: int):  # type: ignore[no-untyped-def]
    import torch

    gen = torch.Generator(device=DEVICE).manual_seed(batch * 7 + context)
    tokens = -(-context // block) * block
    buf = torch.randn((batch, tokens, 2, 2, KV_HEADS, DIM), generator=gen, device=DEVICE,
                      dtype=dtype())
    k, v = buf[:, :, 0, 0], buf[:, :, 0, 1]  # [slot, token, H, D], token stride 2*2*H*D
    per_slot = tokens // block
    nblocks = batch * per_slot
    ident = torch.arange(nblocks, device=DEVICE).view(batch, per_slot)
    kb, vb = k.reshape(nblocks, block, KV_HEADS, DIM), v.reshape(nblocks, block, KV_HEADS, DIM)
    perm = torch.randperm(nblocks, generator=gen, device=DEVICE)
    kp, vp = torch.empty_like(kb), torch.empty_like(vb)
    kp[perm], vp[perm] = kb, vb
    slots = torch.arange(batch, dtype=torch.int32, device=DEVICE)
    lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    return {"contiguous": (k, v, slots), "identity": (kb, vb, ident.to(torch.int32)),
            "shuffled": (kp, vp, perm[ident].to(torch.int32).contiguous())}, lens


def measure_point(res: Result, batch: int, context: int, block: int, *, with_cuda: bool
                  ) -> dict:
    """Time the three addressings of both twin pairs at one point; check they agree."""
    import torch

    from vmkv.kernels import cuda_twins as ct
    from vmkv.kernels import triton_decode as td

    lay, lens = layouts(batch, context, block)
    q = torch.randn(batch, HEADS, DIM, device=DEVICE, dtype=dtype())
    scale = DIM**-0.5
    calls = {}
    for kind, (k, v, index) in lay.items():
        if kind == "contiguous":
            calls[f"triton/{kind}"] = functools.partial(td.decode_contiguous, q, k, v, index,
                                                        lens, scale)
            if with_cuda:
                calls[f"cuda/{kind}"] = functools.partial(ct.decode_contiguous, q, k, v, index,
                                                          lens, scale, max_seq_len=context)
        else:
            calls[f"triton/{kind}"] = functools.partial(td.decode_paged, q, k, v, index, lens,
                                                        scale)
            if with_cuda:
                calls[f"cuda/{kind}"] = functools.partial(ct.decode_paged, q, k, v, index,
                                                          lens, scale, max_seq_len=context)
    row: dict[str, object] = {"batch": batch, "context": context, "block": block}
    outs = {}
    for name, fn in calls.items():
        out = guard(res, f"{name} B={batch} ctx={context}", fn)
        if out is not None:
            outs[name] = out.float()
            row[f"{name}_ms"] = time_ms(fn, warmup=1, iters=1 if ON_CPU else 5,
                                        inner=1 if ON_CPU else 10)["median_ms"]
    ref = outs.get("triton/contiguous")
    if ref is not None:
        diff = max(float((o - ref).abs().max()) for o in outs.values())
        row["max_abs_diff"] = diff
        res.check(f"twins agree B={batch} ctx={context} block={block}", diff < 2e-2,
                  max_abs_diff=diff)
    for fam in ("triton", "cuda"):
        base = row.get(f"{fam}/contiguous_ms")
        for kind in ("identity", "shuffled"):
            if base and f"{fam}/{kind}_ms" in row:
                row[f"{fam}_{kind}_over_contiguous"] = row[f"{fam}/{kind}_ms"] / base
    return row


def main(res: Result) -> None:
    import torch

    from vmkv.kernels import cuda_twins as ct

    deadline = time.monotonic() + BUDGET_S  # the build counts
    t = time.monotonic()
    if ON_CPU and shutil.which("nvcc") is None:
        lib = None
        res.record("cuda_twins_build", "n/a: no nvcc on this CPU machine")
    else:
        lib = guard(res, "nvcc build of the CUDA twins",
                    lambda: ct.build_and_load(arch="sm_90" if ON_CPU else None))
        res.record("cuda_twins_build_s", time.monotonic() - t)
    if ON_CPU:
        res.record("cuda_twins_launch", NA_CPU)
    rows: list[dict] = []
    for batch, context, block in POINTS:
        if time.monotonic() > deadline:
            rows.append({"batch": batch, "context": context, "block": block,
                         "skipped": "budget"})
            res.record("rows", rows)
            continue
        rows.append(measure_point(res, batch, context, block,
                                  with_cuda=lib is not None and not ON_CPU))
        res.record("rows", rows)
        if not ON_CPU:
            torch.cuda.empty_cache()
    done = [r for r in rows if "triton_shuffled_over_contiguous" in r]
    res.check("at least one point measured", bool(done), points=len(done))
    if done:
        ratios = [r["triton_shuffled_over_contiguous"] for r in done]
        res.headline = (f"triton shuffled/contiguous {min(ratios):.2f}-{max(ratios):.2f}x "
                        f"over {len(done)} points")


if __name__ == "__main__":
    run_step("s7_twins", main)
