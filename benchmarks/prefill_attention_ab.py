"""The CPU prefill attention kernel (csrc/cpu_attention.cpp) at two revisions of its source, side
by side in one process: how a change to it is measured on a machine whose speed wanders between
runs.

    python benchmarks/prefill_attention_ab.py --base REV [--prompts 3x680,1x2048] [--json PATH]

Builds the kernel (and every header it includes) as committed at ``--base`` and as in the working
tree, with the engine's flags, and times one prefill step's attention per shape: ``NxL`` is N
prompts of L tokens each, none cached before (the prompt-heavy mix's chunks), the default
model's heads (9 query heads, 3 KV heads, head_dim 64), float32 (what an int8 cache's prefill
reads: its rows dequantized), one call per layer over ``--layers`` layers' K/V, virtual
addressing. The builds alternate per repetition (int8_kernels.time_ways): medians (ms per step),
base / working tree, and whether the outputs are bit-identical. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
from pathlib import Path

import torch

from vmkv.kernels import cpu_attention

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int8_kernels import save, time_ways  # noqa: E402
from kernel_revisions import builds, machine  # noqa: E402

HEADS, KV_HEADS, DIM = 9, 3, 64


def step_ms(libs: dict[str, ctypes.CDLL], prompts: int, length: int, layers: int, repeats: int
            ) -> tuple[dict[str, float], bool]:
    """Each build's median ms for one prefill step's attention over ``layers`` layers of
    ``prompts`` prompts of ``length`` tokens, alternated; and whether the outputs are
    bit-identical."""
    gen = torch.Generator().manual_seed(0)
    tokens = prompts * length
    caches = [(torch.randn(tokens, KV_HEADS, DIM, generator=gen),
               torch.randn(tokens, KV_HEADS, DIM, generator=gen)) for _ in range(layers)]
    q = torch.randn(tokens, HEADS, DIM, generator=gen)
    lens = torch.full((prompts,), length, dtype=torch.int32)
    starts = torch.arange(prompts, dtype=torch.int64) * length
    outs = {name: torch.empty(tokens, HEADS * DIM) for name in libs}

    def step(name: str, q: torch.Tensor) -> None:
        for k, v in caches:
            cpu_attention.prefill(q, k, v, starts.to(torch.int32), lens, lens, DIM ** -0.5,
                                  outs[name], starts=starts, lib=libs[name])

    ways = {name: [lambda q, name=name: step(name, q)] for name in libs}
    ms = time_ways(ways, [q], repeats, 1)
    base, tree = outs.values()
    return ms, torch.equal(base, tree)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the git revision to compare against")
    ap.add_argument("--prompts", default="3x680,1x2048", help="NxL shapes, comma-separated")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder, torch.inference_mode():
        libs = builds(cpu_attention.build, cpu_attention.SOURCE, args.base, Path(folder))
        for shape in args.prompts.split(","):
            prompts, length = (int(n) for n in shape.split("x"))
            ms, identical = step_ms(libs, prompts, length, args.layers, args.repeats)
            rows.append({"prompts": prompts, "length": length, "ms": ms,
                         "base_over_tree": ms[args.base] / ms["tree"], "bit_identical": identical})
            print(f"{shape}: {args.base} {ms[args.base]:.2f} ms, tree {ms['tree']:.2f} ms "
                  f"({rows[-1]['base_over_tree']:.3f}x), bit-identical {identical}", flush=True)
    return save({"bench": "prefill_attention_ab", "base": args.base, "layers": args.layers,
                 "threads": torch.get_num_threads(), "unit": "ms per prefill step (all layers)",
                 "machine": machine(),
                 "rows": rows}, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
