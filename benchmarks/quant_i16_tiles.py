"""GGUF-block products on float32 activations on an AVX2 CPU: the integer products against the
int16 tiles (csrc/cpu_quant_i16_tiles.h; the same results), where ``I16_TILE_ROWS`` comes from.

    python benchmarks/quant_i16_tiles.py [--rows 1,2,4,8,16,32,64,256] [--json PATH]

One decoder layer of the default model (SmolLM2-135M: qkv 960 x 576, o 576 x 576, gate|up
3072 x 576, down 576 x 1536) and its tied LM head (49152 x 576), random weights of the model's
scale quantized to Q4_1 (the file's layers), Q8_0 (the file's head) and U8 (``--quantization
int8``), 2 threads (OMP_NUM_THREADS). Per row count and shape set, the median time of the
products, per way:

    dense-f32          the float32 weights on the packed linear ``--quantization none`` runs
                       here (``vmkv.models.linear``'s ``auto`` backend)
    <format>-integer   vmkv's integer products on the blocks (activations quantised per block)
    <format>-tiles     the blocks widened into int16 tiles once per group of 16 outputs, then
                       vpmaddwd on the activations' int16 codes (AVX2 builds only)

Fresh timings in this process, ways interleaved per repetition; the JSON holds every row count's
medians and the machine. A benchmark, not a test: no assertion on speed.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

import gguf
import torch

from vmkv.kernels import cpu_quant
from vmkv.models.linear import PackedLinear
from vmkv.models.quant.int8 import int8_tensor
from vmkv.models.quant.modules import QuantLinear, QuantTensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int8_kernels import save, time_ways  # noqa: E402
from kernel_revisions import machine  # noqa: E402

LAYER = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in) of one layer
HEAD = ((49152, 576),)
FORMATS = ("q4_1", "q8_0", "u8")


def quant_linear(w: torch.Tensor, fmt: str) -> QuantLinear:
    """``w`` [N, K] in one of FORMATS as vmkv's quantized linear."""
    if fmt == "u8":
        return QuantLinear([int8_tensor(w)])
    ggml = gguf.GGMLQuantizationType[fmt.upper()]
    raw = gguf.quantize(w.numpy(), ggml)
    return QuantLinear([QuantTensor.from_gguf(raw, int(ggml), w.shape[1])])


def products(shapes: tuple[tuple[int, int], ...], formats: tuple[str, ...]
             ) -> dict[str, list[Callable[[torch.Tensor], object]]]:
    """Each way's product per shape (the tile ways switch the library's tiles on per call)."""
    gen = torch.Generator().manual_seed(0)
    lib = cpu_quant.library()
    ways: dict[str, list[Callable[[torch.Tensor], object]]] = {"dense-f32": []}
    for n, k in shapes:
        w = torch.randn(n, k, generator=gen) * 0.05
        dense = torch.nn.Linear(k, n, bias=False)
        dense.weight.data = w
        ways["dense-f32"].append(PackedLinear(dense, 64, "auto"))
        for fmt in formats:
            lin = quant_linear(w, fmt)
            ways.setdefault(f"{fmt}-integer", []).append(
                lambda x, lin=lin: (cpu_quant.use_i16_tiles(lib, 0), lin(x)))
            ways.setdefault(f"{fmt}-tiles", []).append(
                lambda x, lin=lin: (cpu_quant.use_i16_tiles(lib, 1), lin(x)))
    return ways


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,256")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    lib = cpu_quant.library()
    if not cpu_quant.use_i16_tiles(lib, 1):
        ap.error(f"this build ({cpu_quant.code_path()}) has no int16 tiles: AVX2 builds only")
    results = {}
    with torch.inference_mode():
        for part, shapes, formats in (("layer", LAYER, FORMATS), ("head", HEAD, ("q8_0",))):
            ways = products(shapes, formats)
            rows = []
            for m in (int(r) for r in args.rows.split(",")):
                xs = [torch.randn(m, k) for _, k in shapes]
                reps = max(3, (300 if part == "layer" else 30) // m)
                row = {"rows": m, **time_ways(ways, xs, args.repeats, reps)}
                rows.append(row)
                print(f"{part} rows {m:4d}  " + "  ".join(f"{w} {row[w]:.3f}" for w in ways),
                      flush=True)
            results[part] = {"shapes": shapes, "rows": rows}
    cpu_quant.use_i16_tiles(lib)
    result = {"bench": "quant_i16_tiles", "unit": "ms per shape set (median)",
              "threads": torch.get_num_threads(), "code_path": cpu_quant.code_path(),
              "machine": {**machine(), "cpu_count": os.cpu_count(), "torch": torch.__version__},
              **results}
    return save(result, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
