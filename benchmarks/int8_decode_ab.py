"""The int8 KV cache's decode kernel at two revisions of its source, side by side in one process:
how a kernel change is measured on a machine whose speed wanders between runs.

    python benchmarks/int8_decode_ab.py --base 85c0eb7 [--context-lens 300,500] [--block-size 128]
        [--json PATH]

Builds csrc/cpu_attention_int8.cpp (and the headers it includes) as committed at ``--base`` and
as in the working tree, with the engine's flags (``-O3 -march=native``), fills one int8 cache per
layer (``--layers`` of the default model's shapes: 9 query heads, 3 KV heads, head_dim 64, so
a step reads its K/V from memory as the engine's step does, not from the last level cache), and
times one decode step over every layer with each build (int8_kernels.time_ways: the builds
alternated per repetition, each warmed by one step first): medians (ms per step), base /
working tree, and whether their outputs are bit-identical.
Virtual addressing (each request's rows contiguous), or with ``--block-size`` paged addressing
(a block table over the cache's blocks in a shuffled order, as a pool hands them out after
churn). A benchmark, not a test: no assertion on speed.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import sys
import tempfile
from pathlib import Path

import torch

from vmkv.kernels import cpu_attention_int8

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int8_kernels import save, time_ways  # noqa: E402
from kernel_revisions import builds, machine  # noqa: E402

HEADS, KV_HEADS, DIM = 9, 3, 64


def step_ms(libs: dict[str, ctypes.CDLL], batch: int, context: int, layers: int,
            repeats: int, block_size: int = 0) -> tuple[dict[str, float], bool]:
    """Each build's median ms for one decode step over ``layers`` caches of ``batch`` requests
    at ``context`` tokens, alternated; and whether the builds' outputs are bit-identical.
    ``block_size`` > 0: paged addressing through a shuffled block table."""
    gen = torch.Generator().manual_seed(0)
    slot = context + 64
    if block_size:
        slot = -(-slot // block_size) * block_size  # whole blocks a request
    caches = []
    for _ in range(layers):
        k = torch.zeros(batch * slot, KV_HEADS, DIM + 2, dtype=torch.int8)
        v = torch.zeros_like(k)
        cpu_attention_int8.store(k, v, torch.arange(batch * slot),
                                 torch.randn(batch * slot, KV_HEADS, DIM, generator=gen),
                                 torch.randn(batch * slot, KV_HEADS, DIM, generator=gen))
        caches.append((k, v))
    q = torch.randn(batch, HEADS, DIM, generator=gen)
    lens = torch.full((batch,), context, dtype=torch.int32)
    where: dict = {"starts": torch.arange(batch, dtype=torch.int64) * slot}
    if block_size:
        blocks = torch.randperm(batch * slot // block_size, generator=gen).to(torch.int32)
        where = {"block_table": blocks.view(batch, slot // block_size),
                 "block_size": block_size}
    outs = {name: torch.empty(batch, HEADS * DIM) for name in libs}

    def step(name: str, q: torch.Tensor) -> None:
        for k, v in caches:
            cpu_attention_int8.decode(q, k, v, lens, DIM ** -0.5, out=outs[name],
                                      lib=libs[name], **where)

    ms = time_ways({name: [functools.partial(step, name)] for name in libs}, [q], repeats, 1)
    base, tree = outs.values()
    return ms, torch.equal(base, tree)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the git revision to compare against")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context-lens", default="300,500")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--block-size", type=int, default=0,
                    help="paged addressing with blocks of this many tokens (0: virtual)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder, torch.inference_mode():
        libs = builds(cpu_attention_int8.build, cpu_attention_int8.SOURCE, args.base, Path(folder))
        for context in (int(c) for c in args.context_lens.split(",")):
            ms, identical = step_ms(libs, args.batch, context, args.layers, args.repeats,
                                    args.block_size)
            rows.append({"context": context, "ms": ms, "base_over_tree": ms[args.base] / ms["tree"],
                         "bit_identical": identical})
            print(f"context {context}: {args.base} {ms[args.base]:.2f} ms, tree {ms['tree']:.2f} "
                  f"ms ({rows[-1]['base_over_tree']:.2f}x), bit-identical {identical}", flush=True)
    return save({"bench": "int8_decode_ab", "base": args.base, "batch": args.batch,
                 "addressing": f"paged, blocks of {args.block_size}" if args.block_size
                 else "virtual",
                 "layers": args.layers, "threads": torch.get_num_threads(),
                 "unit": "ms per decode step (all layers)",
                 "machine": machine(),
                 "rows": rows}, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
