"""Which int8 weight grid agrees best with the model: symmetric per block (GGUF's Q8_0 of the
weight), asymmetric per block (``--quantization int8``'s U8: a scale and a minimum), and the
symmetric grid with GPTQ's error feedback; on the default model as it is (its weights came from
a Q4_1 file) and moved off its 4-bit grid.

    python benchmarks/int8_grids.py [--grids sym,asym,gptq] [--off-grid] [--json PATH]

Each grid is fake-quantized (the rounded weights kept in float32, float32 products) into the
default model's decoder linears at load, then ``vmkv bench accuracy``'s teacher-forced top-1
agreement and perplexity against the float32 model (2,044 positions of the project's docs).
``--off-grid`` first adds N(0, (d/4)^2) to every weight, d its block's 4-bit step
((max - min) / 15 over 32 inputs), seeded per tensor, in the reference as well: weights without
the file's 16 levels a block. GPTQ (Frantar et al., 2023): column by column in blocks of 128,
each block of 32 inputs scaled when reached, the rounding error spread over the later columns
through the inverse Hessian's Cholesky factor, Hessians ``X^T X`` from the dense model on
``vmkv/models/quant/calibration.txt``, damping 1 % of the mean diagonal. A measurement, not a
test: no assertion.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch
from torch import nn

GRIDS = ("sym", "asym", "gptq")


def symmetric(w: torch.Tensor) -> torch.Tensor:
    """``w [N, K]`` rounded to Q8_0's grid: per block of 32, ``s q``, s = fp16(max|w| / 127)."""
    from vmkv.models.quant.int8 import channel_int8

    codes, scale = channel_int8(w.reshape(-1, 32))  # a block per row
    return (codes.float() * scale.float()[:, None]).reshape(w.shape)


def asymmetric(w: torch.Tensor) -> torch.Tensor:
    """``w [N, K]`` rounded to U8's grid (vmkv.models.quant.int8.u8_blocks, decoded)."""
    from vmkv.models.quant.int8 import u8_blocks, u8_dequantize

    return u8_dequantize(u8_blocks(w), w.shape[1])


@torch.no_grad()
def gptq(w: torch.Tensor, hessian: torch.Tensor, damp: float = 0.01, lazy: int = 128
         ) -> torch.Tensor:
    """``w [N, K]`` on Q8_0's grid with GPTQ's error feedback under ``hessian [K, K]``."""
    w, h = w.float().clone(), hessian.clone()
    dead = torch.diag(h) == 0
    h[dead, dead], w[:, dead] = 1, 0
    h += damp * torch.diag(h).mean() * torch.eye(h.shape[0])
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    out = torch.zeros_like(w)
    for i1 in range(0, w.shape[1], lazy):
        i2 = min(i1 + lazy, w.shape[1])
        block, hb = w[:, i1:i2].clone(), hinv[i1:i2, i1:i2]  # [N, <=lazy], [<=lazy, <=lazy]
        errors = torch.zeros_like(block)
        for i in range(i2 - i1):
            if i % 32 == 0:
                s = (block[:, i : i + 32].abs().amax(1) / 127).to(torch.float16).float()  # [N]
            q = torch.round(block[:, i] / torch.where(s > 0, s, 1)).clamp(-127, 127) * s
            out[:, i1 + i] = q
            errors[:, i] = (block[:, i] - q) / hb[i, i]
            block[:, i:] -= errors[:, i : i + 1] @ hb[i : i + 1, i:]
        w[:, i2:] -= errors @ hinv[i1:i2, i2:]
    return out


@torch.no_grad()
def hessians(model: nn.Module) -> dict[int, torch.Tensor]:
    """Per decoder linear (by id), ``X^T X / n`` of its inputs over the calibration text."""
    from vmkv.models import resolve_model
    from vmkv.models.quant import smooth

    ids = smooth.calibration_ids(resolve_model(None, progress=False), model.config.vocab_size)
    sums: dict[int, torch.Tensor] = {}
    counts: dict[int, int] = {}

    def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        x = args[0].float()  # [T, K]
        sums[id(module)] = sums.get(id(module), 0) + x.T @ x
        counts[id(module)] = counts.get(id(module), 0) + x.shape[0]

    hooks = [m.register_forward_pre_hook(hook) for m in model.layers.modules()
             if isinstance(m, nn.Linear)]
    try:
        smooth.input_maxima(model, ids)  # the same causal pass; its own maxima unused
    finally:
        for h in hooks:
            h.remove()
    return {key: sums[key] / counts[key] for key in sums}


def off_grid(model: nn.Module) -> None:
    """Every decoder weight + N(0, (d/4)^2), d = its block's (max - min) / 15, seeded per name."""
    for name, lin in model.layers.named_modules():
        if isinstance(lin, nn.Linear):
            b = lin.weight.float().reshape(lin.weight.shape[0], -1, 32)
            step = (b.amax(-1, keepdim=True) - b.amin(-1, keepdim=True)) / 15
            seed = int(hashlib.sha1(name.encode()).hexdigest()[:8], 16)
            noise = torch.randn(b.shape, generator=torch.Generator().manual_seed(seed))
            lin.weight.copy_((b + noise * step / 4).reshape(lin.weight.shape))


def measure(grid: str, moved: bool) -> dict:
    """One grid's agreement and perplexity against the (moved) float32 model."""
    import vmkv.models.loader as loader
    from vmkv.bench import accuracy
    from vmkv.models.llama import LlamaModel

    load_weights = LlamaModel.load_weights

    def load(self: LlamaModel, state: dict) -> None:
        load_weights(self, state)
        if moved:
            off_grid(self)

    def fake_quantize(model: nn.Module, mode: str) -> int:  # replaces int8's real kernels
        stats = hessians(model) if grid == "gptq" else {}
        for lin in model.layers.modules():
            if isinstance(lin, nn.Linear):
                rounded = (gptq(lin.weight, stats[id(lin)]) if grid == "gptq"
                           else symmetric(lin.weight) if grid == "sym" else asymmetric(lin.weight))
                lin.weight.copy_(rounded)
        return 0

    LlamaModel.load_weights, loader.quantize_linears = load, fake_quantize  # type: ignore
    try:
        rows = accuracy.run(["int8:float32"], "none:float32")["rows"]
    finally:
        LlamaModel.load_weights = load_weights  # type: ignore[method-assign]
    row = next(r for r in rows if r["variant"] == "int8:float32")
    return {"grid": grid, "off_grid": moved, "agreement": row["agreement"],
            "ppl_ratio": row["ppl_ratio"], "positions": row["positions"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grids", default=",".join(GRIDS))
    parser.add_argument("--off-grid", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from vmkv.bench.report import environment

    results = []
    for grid in args.grids.split(","):
        if grid not in GRIDS:
            raise SystemExit(f"--grids takes {GRIDS}, got {grid!r}")
        results.append(measure(grid, args.off_grid))
        print(json.dumps(results[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"environment": environment(), "results": results},
                                        indent=1))


if __name__ == "__main__":
    main()
