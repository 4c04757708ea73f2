"""Which library's bfloat16 GEMM the CPU linears use, chosen by measurement.

Side by side in one process, interleaved, at the default model's linear shapes and the row
counts of decode (1-64) and prefill (256-2048) steps, bf16 in and out:

    brgemm    vmkv's driver over oneDNN's brgemm ukernel (AMX; weights packed once at load)
    onednn    torch.ops.mkldnn._linear_pointwise on a weight reordered once (oneDNN matmul)
    mkl       MKL's cblas_gemm_bf16bf16f32 (torch exports no packed variant: B read each call)
    f32-mkl   the float32 engine's MKL packed sgemm, for reference

    python benchmarks/bf16_gemm.py --json out.json [--plot out.png] [--repeats 7]

Each figure is the best of ``--repeats`` timings of a few calls (warm caches, weights resident
as in a step that reuses them). Needs a CPU with bfloat16 hardware.
"""

from __future__ import annotations

import argparse
import ctypes
import time
from collections.abc import Callable
from pathlib import Path

import torch

from vmkv.bench.report import format_table, write_json
from vmkv.kernels import cpu_bf16
from vmkv.models.linear import PackedLinear

#: (in, out) of the default model's linears: qkv, o, gate|up, down, and the LM head
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]
ROWS = [1, 4, 16, 64, 256, 2048]


def _mkl_unpacked() -> Callable[..., None]:
    lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
    fn = lib.cblas_gemm_bf16bf16f32
    c_int, c_ptr = ctypes.c_int, ctypes.c_void_p
    fn.argtypes = [c_int] * 6 + [ctypes.c_float, c_ptr, c_int, c_ptr, c_int, ctypes.c_float,
                                 c_ptr, c_int]
    return fn


def best_ms(fn: Callable[[], object], repeats: int, calls: int = 4) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


def candidates(m: int, k: int, n: int, mkl: Callable[..., None]
               ) -> dict[str, Callable[[], object]]:
    """The four GEMMs of ``[m, k] x [k, n]``, each ready to call."""
    linear = torch.nn.Linear(k, n, bias=False).to(torch.bfloat16).requires_grad_(False)
    brgemm = PackedLinear(linear, 64, "brgemm")
    f32 = PackedLinear(torch.nn.Linear(k, n, bias=False).requires_grad_(False), 64, "mkl")
    x = torch.randn(m, k).to(torch.bfloat16)
    x32, out, w = x.float(), torch.empty(m, n), linear.weight
    onednn_w = torch.ops.mkldnn._reorder_linear_weight(w, m)
    return {
        "brgemm": lambda: brgemm(x),
        "onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, onednn_w, None, "none", [], ""),
        "mkl": lambda: mkl(101, 111, 112, m, n, k, 1.0, x.data_ptr(), k, w.data_ptr(), k, 0.0,
                           out.data_ptr(), n),
        "f32-mkl": lambda: f32(x32),
    }


def run(repeats: int) -> list[dict[str, object]]:
    mkl = _mkl_unpacked()
    rows_out: list[dict[str, object]] = []
    for k, n in SHAPES:
        for m in ROWS:
            if n == 49152 and m > 64:
                continue  # the LM head sees one row per sampled sequence
            fns = candidates(m, k, n, mkl)
            times = dict.fromkeys(fns, float("inf"))
            for _ in range(3):  # interleaved rounds: drift of a shared machine hits all alike
                for name, fn in fns.items():
                    times[name] = min(times[name], best_ms(fn, repeats))
            flops = 2 * m * n * k
            rows_out.append({"in": k, "out": n, "rows": m,
                             **{f"{name} ms": t for name, t in times.items()},
                             **{f"{name} TF/s": flops / t / 1e9 for name, t in times.items()}})
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    reason = cpu_bf16.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"cannot run: {reason}")
    rows = run(args.repeats)
    cols = ["in", "out", "rows", "brgemm ms", "onednn ms", "mkl ms", "f32-mkl ms"]
    print(format_table(rows, cols))
    write_json(args.json, {"bench": "bf16_gemm", "threads": torch.get_num_threads(),
                           "rows": rows})
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(SHAPES), figsize=(4 * len(SHAPES), 3.5), sharey=True)
        for ax, (k, n) in zip(axes, SHAPES, strict=True):
            sel = [r for r in rows if r["in"] == k and r["out"] == n]
            for name in ("brgemm", "onednn", "mkl", "f32-mkl"):
                ax.plot([r["rows"] for r in sel], [r[f"{name} TF/s"] for r in sel], "o-",
                        label=name)
            ax.set_xscale("log")
            ax.set_title(f"{k} -> {n}")
            ax.set_xlabel("rows (tokens in the step)")
        axes[0].set_ylabel("TFLOP/s")
        axes[0].legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
