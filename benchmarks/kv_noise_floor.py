"""How far a bfloat16 model's teacher-forced top-1 moves when its KV cache moves a little: the
noise floor under ``vmkv bench accuracy``'s agreement bar for compressed KV caches.

    python benchmarks/kv_noise_floor.py --json OUT.json [--positions 2000] [--kv-mode virtual]
        [--schemes all | name,name,...]

Each scheme perturbs every K/V row the engine writes (the real engine, the default model in
bfloat16, a bfloat16 cache, prefill chunks of 512 as ``vmkv bench accuracy`` scores them) and
is scored against the unperturbed cache: top-1 agreement and perplexity ratio. The perturbation
wraps :meth:`CpuAttentionBackend.write_kv` in this process only (K/V as float32, perturbed,
rounded back to bfloat16), so the schemes include:

    identity                     nothing changed (the engine is deterministic: 100 %)
    1-ulp-1pct                   1 % of the values one bfloat16 step up
    bf16-round-trip-rotated      rotated (Hadamard), rounded to bfloat16, rotated back
    int16 / int12 / int10        per token and head, symmetric, rotated (finer than int8)
    int8-rotated                 what --kv-cache-dtype int8 stores (the same agreement as the
                                 real int8 cache: the kernels dequantise to bfloat16 too)
    int8-rotated-sinks4          the same, the first 4 positions kept exact
    int8-asymmetric              rotated, min/max with a zero point
    int8-fp32-scale              rotated, a float32 scale
    int8-unrotated               per token and head, no rotation
    kivi                         KIVI: K per channel over groups of 32 tokens, V per token
                                 (both asymmetric, no rotation)
    kivi-rotated-k               K rotated, per channel over 32 tokens; V int8-rotated
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
Fake = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (x, req, pos) -> x


def symmetric(x: torch.Tensor, bits: int = 8, scale_dtype: torch.dtype = torch.float16
              ) -> torch.Tensor:
    """``x [..., D]`` quantised per row (last dim) to ``bits`` with one absmax scale."""
    qmax = 2 ** (bits - 1) - 1
    s = (x.abs().amax(-1, keepdim=True) / qmax).to(scale_dtype).float()
    inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
    return (x * inv).round().clamp(-qmax, qmax) * s


def asymmetric(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``x`` quantised to 8 bits along ``dim`` with a float16 scale and zero point."""
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    s, z = ((hi - lo) / 255).half().float(), lo.half().float()
    inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
    return ((x - z) * inv).round().clamp(0, 255) * s + z


def per_channel(x: torch.Tensor, req: torch.Tensor, pos: torch.Tensor, group: int = 32
                ) -> torch.Tensor:
    """``x [T, H, D]`` quantised per channel over each request's groups of ``group`` tokens."""
    out = x.clone()
    key = req * (1 << 32) + pos // group
    for g in torch.unique(key):
        rows = key == g
        out[rows] = asymmetric(x[rows], dim=0)
    return out


def schemes() -> dict[str, tuple[Fake | None, Fake | None, int]]:
    """name -> (K's perturbation, V's, exact leading positions)."""
    from vmkv.kernels.cpu_attention_int8 import hadamard_reference as had

    def rotated(f: Callable[[torch.Tensor], torch.Tensor]) -> Fake:
        return lambda x, req, pos: had(f(had(x)))

    def plain(f: Callable[[torch.Tensor], torch.Tensor]) -> Fake:
        return lambda x, req, pos: f(x)

    def one_ulp(x: torch.Tensor, req: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        up = (x.bfloat16().view(torch.int16) + 1).view(torch.bfloat16).float()
        gen = torch.Generator().manual_seed(int(pos.sum()))
        return torch.where(torch.rand(x.shape, generator=gen) < 0.01, up, x)

    int8 = rotated(symmetric)
    return {
        "identity": (None, None, 0),
        "1-ulp-1pct": (one_ulp, one_ulp, 0),
        "bf16-round-trip-rotated": (rotated(lambda x: x.bfloat16().float()),) * 2 + (0,),
        "int16": (rotated(lambda x: symmetric(x, 16)),) * 2 + (0,),
        "int12": (rotated(lambda x: symmetric(x, 12)),) * 2 + (0,),
        "int10": (rotated(lambda x: symmetric(x, 10)),) * 2 + (0,),
        "int8-rotated": (int8, int8, 0),
        "int8-rotated-sinks4": (int8, int8, 4),
        "int8-asymmetric": (rotated(asymmetric),) * 2 + (0,),
        "int8-fp32-scale": (rotated(lambda x: symmetric(x, 8, torch.float32)),) * 2 + (0,),
        "int8-unrotated": (plain(symmetric),) * 2 + (0,),
        "kivi": (per_channel, plain(asymmetric), 0),
        "kivi-rotated-k": (lambda x, req, pos: had(per_channel(had(x), req, pos)), int8, 0),
    }


def perturbing(k_fake: Fake | None, v_fake: Fake | None, sinks: int) -> Callable:
    """A ``write_kv`` that perturbs the rows first, then writes them as the backend does."""
    from vmkv.attention import cpu
    from vmkv.attention.step import token_positions

    original = cpu.CpuAttentionBackend.write_kv

    def write_kv(self, layer, k, v, meta):  # noqa: ANN001, ANN202 (the backend's signature)
        req, pos = token_positions(np.asarray(meta.context_lens, dtype=np.int64),
                                   np.asarray(meta.query_lens, dtype=np.int64))
        req_t, pos_t = torch.from_numpy(req), torch.from_numpy(pos)
        kf, vf = k.float(), v.float()
        k2 = k_fake(kf, req_t, pos_t) if k_fake else kf
        v2 = v_fake(vf, req_t, pos_t) if v_fake else vf
        if sinks:
            exact = (pos_t < sinks).view(-1, 1, 1)
            k2, v2 = torch.where(exact, kf, k2), torch.where(exact, vf, v2)
        return original(self, layer, k2.to(k.dtype), v2.to(v.dtype), meta)

    return write_kv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, type=Path)
    parser.add_argument("--positions", type=int, default=2000)
    parser.add_argument("--kv-mode", default="virtual", choices=("virtual", "paged"))
    parser.add_argument("--schemes", default="all")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from vmkv.attention import cpu
    from vmkv.bench import accuracy
    from vmkv.models import load_tokenizer, resolve_model

    table = schemes()
    names = list(table) if args.schemes == "all" else args.schemes.split(",")
    unknown = sorted(set(names) - set(table))
    if unknown:
        raise SystemExit(f"unknown schemes {unknown}; choose from {list(table)}")
    ids, source = accuracy.text_tokens(load_tokenizer(resolve_model(None, progress=False)),
                                       None, ROOT)
    chunk = 512
    need = -(-args.positions // (chunk - 1)) * chunk
    chunks = [ids[i: i + chunk] for i in range(0, need, chunk)]
    options = dict(kv_mode=args.kv_mode, max_model_len=1024, max_num_batched_tokens=2048,
                   enable_prefix_caching=False, quantization="none", dtype="bfloat16",
                   kv_cache_dtype="auto")
    ref = accuracy.score(options, chunks)
    original = cpu.CpuAttentionBackend.write_kv
    rows = []
    for name in names:
        cpu.CpuAttentionBackend.write_kv = perturbing(*table[name])
        try:
            s = accuracy.score(options, chunks)
        finally:
            cpu.CpuAttentionBackend.write_kv = original
        agree = sum(a == b for a, b in zip(s.top1, ref.top1, strict=True)) / len(s.top1)
        rows.append({"scheme": name, "positions": len(s.top1), "agreement": agree,
                     "ppl_ratio": s.perplexity / ref.perplexity})
        print(f"{name:26s} agreement {agree:.4f}  ppl ratio {rows[-1]['ppl_ratio']:.4f}",
              flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "bench": "kv_noise_floor", "text": source, "chunk": chunk, "kv_mode": args.kv_mode,
        "reference": "none:bfloat16 (bfloat16 KV)", "reference_perplexity": ref.perplexity,
        "machine": platform.processor() or platform.machine(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
