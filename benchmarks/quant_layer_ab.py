"""The quantized-weight products (csrc/cpu_quant_layer.cpp) at two revisions of their source,
side by side in one process: how a change to them is measured on a machine whose speed wanders
between runs.

    python benchmarks/quant_layer_ab.py --base REV [--rows 64,680,2048] [--format q4_1] \
        [--json PATH]

Builds the library (and every header it includes) as committed at ``--base`` and as in the
working tree, with the engine's flags, and times one decoder layer's four products of the default
model (SmolLM2-135M: qkv 960 x 576, o 576 x 576, gate|up 3072 x 576, down 576 x 1536; random
weights of the model's scale in ``--format``, the file's Q4_1 by default) on float32 activations
of each row count, the builds alternated per repetition (int8_kernels.time_ways): medians (ms),
base / working tree, GFLOP/s, and whether the outputs are bit-identical. Float32 products take
the library's default route (the int16 tiles from VMKV_QUANT_I16_TILE_ROWS rows on in AVX2
builds, integer products elsewhere). A benchmark, not a test: no assertion on speed.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
from pathlib import Path

import torch

from vmkv.kernels import cpu_quant

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int8_kernels import save, time_ways  # noqa: E402
from kernel_revisions import builds, machine  # noqa: E402
from quant_i16_tiles import LAYER, quant_linear  # noqa: E402


def layer_ms(libs: dict[str, ctypes.CDLL], rows: int, fmt: str, repeats: int
             ) -> tuple[dict[str, float], bool]:
    """Each build's median ms for the layer's four products of ``rows`` rows, alternated; and
    whether the builds' outputs are bit-identical."""
    gen = torch.Generator().manual_seed(0)
    linears = [quant_linear(torch.randn(n, k, generator=gen) * 0.05, fmt) for n, k in LAYER]
    xs = [torch.randn(rows, k, generator=gen) for _, k in LAYER]
    outs = {name: [torch.empty(rows, n) for n, _ in LAYER] for name in libs}

    def product(name: str, i: int, x: torch.Tensor) -> None:
        out = outs[name][i]
        err = libs[name].vmkv_qf32_linear(ctypes.byref(linears[i].args()), x.data_ptr(),
                                          x.stride(0), rows, out.data_ptr(), out.stride(0), 0,
                                          None)
        if err:
            raise SystemExit(f"the {name} build refused a {tuple(x.shape)} product ({err})")

    ways = {name: [lambda x, name=name, i=i: product(name, i, x) for i in range(len(LAYER))]
            for name in libs}
    reps = max(1, round(2e9 / (2 * rows * sum(n * k for n, k in LAYER))))
    ms = time_ways(ways, xs, repeats, reps)
    base, tree = outs.values()
    return ms, all(torch.equal(a, b) for a, b in zip(base, tree, strict=True))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the git revision to compare against")
    ap.add_argument("--rows", default="64,680,2048")
    ap.add_argument("--format", default="q4_1", choices=("q4_0", "q4_1", "q5_0", "q8_0", "u8"))
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    flop_per_row = 2 * sum(n * k for n, k in LAYER)
    results = []
    with tempfile.TemporaryDirectory() as folder, torch.inference_mode():
        libs = builds(cpu_quant.build, cpu_quant.SOURCE, args.base, Path(folder))
        for rows in (int(r) for r in args.rows.split(",")):
            ms, identical = layer_ms(libs, rows, args.format, args.repeats)
            gflops = {name: flop_per_row * rows / t / 1e6 for name, t in ms.items()}
            results.append({"rows": rows, "ms": ms, "gflops": gflops,
                            "base_over_tree": ms[args.base] / ms["tree"],
                            "bit_identical": identical})
            print(f"rows {rows}: {args.base} {ms[args.base]:.3f} ms ({gflops[args.base]:.0f} "
                  f"GFLOP/s), tree {ms['tree']:.3f} ms ({gflops['tree']:.0f} GFLOP/s), "
                  f"{results[-1]['base_over_tree']:.3f}x, bit-identical {identical}", flush=True)
    return save({"bench": "quant_layer_ab", "base": args.base, "format": args.format,
                 "threads": torch.get_num_threads(), "code_path": cpu_quant.code_path(),
                 "unit": "ms per layer's four products (median)",
                 "machine": machine(),
                 "rows": results}, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
