"""int8 weights' products on the CPU: vmkv's own kernels against torch's int8 ops (oneDNN/ATen),
the comparison issue 54 asks for before writing kernels of our own.

    python benchmarks/int8_kernels.py [--rows 1,8,32,64,256] [--json PATH]

One decoder layer of the default model (SmolLM2-135M: qkv 960 x 576, o 576 x 576, gate|up
3072 x 576, down 576 x 1536), int8 weights (per output channel; vmkv-int8 per block of 32),
bfloat16 activations (``--dtype``), 2 threads (OMP_NUM_THREADS). Per row count the median time
of the layer's four products, per way:

    dense-bf16     the bf16 weights on vmkv's brgemm linear (``--quantization none``'s path)
    vmkv-int8      vmkv's integer products on the weight's U8 blocks (per block of 32: d u + m)
                   (``--quantization int8``; 16+ rows: dequantized bf16 tiles on the ukernel)
    torch-int8pack torch's weight-only int8 GEMM, ``aten._weight_int8pack_mm`` (bf16 x int8)
    torch-w8a8     activations quantised per token to int8, ``torch._int_mm`` (int8 x int8 ->
                   int32), rescaled (``--quantization w8a8``'s path, vmkv.models.quant.int8)
    vmkv-q8_0      vmkv's integer products on the weight's Q8_0 blocks (symmetric, no minimum:
                   ``--quantization int8`` before session 25), for U8's cost

``--ways`` picks some (``--ways vmkv-int8,vmkv-q8_0 --dtype float32`` runs without bf16
hardware, where the dense bf16 linear and torch's int8 ops want it).

Fresh timings in this process, engines interleaved per repetition; the JSON holds every row
count's medians and the machine. A benchmark, not a test: no assertion on speed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import gguf
import torch

from vmkv.kernels import cpu_bf16
from vmkv.models.quant.int8 import W8A8Linear, channel_int8, int8_tensor
from vmkv.models.quant.modules import QuantLinear, QuantTensor

Q8_0 = int(gguf.GGMLQuantizationType.Q8_0)

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in) of one layer


WAYS = ("dense-bf16", "vmkv-int8", "torch-int8pack", "torch-w8a8", "vmkv-q8_0")


def layer_products(dtype: torch.dtype, names: tuple[str, ...] = WAYS
                   ) -> dict[str, list[Callable[[torch.Tensor], object]]]:
    """Each way's product per linear of the layer (random weights of the model's scale)."""
    gen = torch.Generator().manual_seed(0)
    ways: dict[str, list[Callable[[torch.Tensor], object]]] = {name: [] for name in names}
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=gen) * 0.05
        if "dense-bf16" in ways:
            gemm = cpu_bf16.gemm_args(dtype=dtype)
            packed = cpu_bf16.pack_weight(w.to(dtype), cpu_bf16.block_n(n))
            args = cpu_bf16.linear_args(packed, None, k, n)
            ways["dense-bf16"].append(
                lambda x, a=args, g=gemm: cpu_bf16.linear(x, a, g, dtype))
        if "vmkv-int8" in ways:
            ways["vmkv-int8"].append(QuantLinear([int8_tensor(w)]))
        if "vmkv-q8_0" in ways:
            raw = gguf.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0)
            ways["vmkv-q8_0"].append(QuantLinear([QuantTensor.from_gguf(raw, Q8_0, k)]))
        codes, scale = channel_int8(w)
        scales = scale.to(dtype)
        if "torch-int8pack" in ways:
            ways["torch-int8pack"].append(
                lambda x, c=codes, s=scales: torch.ops.aten._weight_int8pack_mm(x, c, s))
        if "torch-w8a8" in ways:
            lin = torch.nn.Linear(k, n, bias=False)
            lin.weight.data = w
            ways["torch-w8a8"].append(W8A8Linear(lin))
    return ways


def median_ms(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def time_ways(ways: dict[str, list[Callable[[torch.Tensor], object]]], xs: list[torch.Tensor],
              repeats: int, reps: int) -> dict[str, float]:
    """Each way's median ms for its products on ``xs`` (one per product), the ways interleaved
    per repetition, each warmed once before timing ``reps`` calls."""
    times: dict[str, list[float]] = {w: [] for w in ways}
    for _ in range(repeats):
        for way, fns in ways.items():
            def run(fns: list = fns) -> None:
                for fn, x in zip(fns, xs, strict=True):
                    fn(x)
            run()  # warm
            times[way].append(median_ms(run, reps))
    return {w: statistics.median(t) for w, t in times.items()}


def save(result: dict, path: str | None) -> int:
    """``result`` written to ``path`` as JSON (nothing without one); the exit status, 0."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=1))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,32,64,256")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--ways", default=",".join(WAYS), help=f"some of {', '.join(WAYS)}")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = ap.parse_args()
    names = tuple(args.ways.split(","))
    if set(names) - set(WAYS):
        ap.error(f"--ways takes {', '.join(WAYS)}, got {args.ways}")
    dtype = getattr(torch, args.dtype)
    ways = layer_products(dtype, names)
    shapes_in = [k for _, k in SHAPES]
    rows = []
    with torch.inference_mode():
        for m in (int(r) for r in args.rows.split(",")):
            xs = [torch.randn(m, k).to(dtype) for k in shapes_in]
            row = {"rows": m, **time_ways(ways, xs, args.repeats, max(5, 1500 // m))}
            rows.append(row)
            print(f"rows {m:4d}  " + "  ".join(f"{w} {row[w]:.3f} ms" for w in ways), flush=True)
    result = {"bench": "int8_kernels", "shapes": SHAPES, "dtype": args.dtype,
              "threads": torch.get_num_threads(), "unit": "ms per layer (four products)",
              "machine": {"cpu": platform.processor() or platform.machine(),
                          "cpu_count": os.cpu_count(), "torch": torch.__version__},
              "rows": rows}
    return save(result, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
