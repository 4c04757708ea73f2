"""How far a peers sitting's engines are from the arithmetic floor of its workloads on this CPU:
what ratio over the best peer the model's FLOPs leave room for at all.

    python benchmarks/flop_floor.py DIR/best_peers.json [--dtype float32] [--json PATH]

For each mix of a ``best_peers.py`` sitting (its workload regenerated from the sitting's seed
and lengths), the default model's floating-point work: the linear layers for every token an
engine feeds (prompt tokens and every output token but the last), the LM head for every output
token, attention for every fed token over the keys it sees (causal: position t sees t + 1 keys;
QK^T and PV, 4 FLOPs per key and head dimension). Its **floor** is that work at the fastest rate
this CPU has shown for the model's own products: the default model's four layer products on
2048 rows of ``--dtype`` activations through vmkv's quantized-weight library (the GGUF file's
Q4_1; an AVX2 build takes its int16 tiles), the best of
``--repeats`` timings, so the floor is one no engine here is likely to beat (attention, the
LM head and the elementwise work counted at that rate too, nothing else counted). Printed per
mix: the work, the floor's output tokens/s, every engine's median and the share of the floor it
reaches, and the best ratio over the sitting's best peer that the floor allows.
Measure on the machine of the sitting, with nothing else running; a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from argparse import Namespace
from pathlib import Path
from typing import Any

import torch

from vmkv.bench.workloads import load_jsonl
from vmkv.cpu_info import cpu_features, cpu_model
from vmkv.models import load_model_config, resolve_model
from vmkv.models.config import ModelConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
from best_peers import write_workload  # noqa: E402
from int8_kernels import save  # noqa: E402
from quant_i16_tiles import LAYER, quant_linear  # noqa: E402

RATE_ROWS = 2048  # rows of the products timed for the rate (a prefill step's token budget)


def linear_flops_per_token(cfg: ModelConfig) -> int:
    """FLOPs of one token through every decoder layer's linears (q, k, v, o, gate, up, down)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size \
        + 3 * cfg.hidden_size * cfg.intermediate_size
    return 2 * cfg.num_layers * per_layer


def mix_flops(cfg: ModelConfig, lengths: list[tuple[int, int]]) -> dict[str, float]:
    """The work of requests of (prompt, output) lengths, by part (FLOPs)."""
    fed = sum(p + o - 1 for p, o in lengths)
    keys = sum((p + o - 1) * (p + o) // 2 for p, o in lengths)  # sum over fed tokens of t + 1
    return {"linear": float(fed * linear_flops_per_token(cfg)),
            "lm_head": float(sum(o for _, o in lengths) * 2 * cfg.hidden_size * cfg.vocab_size),
            "attention": float(keys * 4 * cfg.head_dim * cfg.num_heads * cfg.num_layers)}


def product_rate(dtype: torch.dtype, repeats: int) -> float:
    """The best GFLOP/s of the default model's four layer products on RATE_ROWS rows."""
    gen = torch.Generator().manual_seed(0)
    linears = [quant_linear(torch.randn(n, k, generator=gen) * 0.05, "q4_1") for n, k in LAYER]
    xs = [torch.randn(RATE_ROWS, k, generator=gen).to(dtype) for _, k in LAYER]
    flops = 2 * RATE_ROWS * sum(n * k for n, k in LAYER)
    best = float("inf")
    with torch.inference_mode():
        for lin, x in zip(linears, xs, strict=True):
            lin(x)  # warm
        for _ in range(repeats):
            start = time.perf_counter()
            for lin, x in zip(linears, xs, strict=True):
                lin(x)
            best = min(best, time.perf_counter() - start)
    return flops / best / 1e9


def mix_lengths(mix: str, entry: dict[str, Any], config: dict[str, Any], model: str
                ) -> list[tuple[int, int]]:
    """The (prompt, output) lengths of a sitting's mix, its workload made again."""
    args = Namespace(length_scale=config["length_scale"], num_prompts=config["num_prompts"],
                     seed=config["seed"], model=model)
    with tempfile.TemporaryDirectory() as folder:
        info = write_workload(mix, args, Path(folder) / "workload.jsonl")
        rows = load_jsonl(Path(folder) / "workload.jsonl")
    if (info["input_tokens"], info["output_tokens"]) != (entry["workload"]["input_tokens"],
                                                         entry["workload"]["output_tokens"]):
        raise SystemExit(f"{mix}: the regenerated workload differs from the sitting's")
    return [(len(r.prompt_token_ids), r.output_len) for r in rows]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("peers", help="a best_peers.json")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the activations of the products timed (what the engines computed in)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    state = json.loads(Path(args.peers).read_text())
    model = str(resolve_model(None, progress=False))
    cfg = load_model_config(model)
    rate = product_rate(getattr(torch, args.dtype), args.repeats)
    print(f"best product rate: {rate:.1f} GFLOP/s ({args.dtype}, {RATE_ROWS} rows, "
          f"{torch.get_num_threads()} threads, {cpu_model()})")
    mixes = {}
    for mix, entry in state["mixes"].items():
        lengths = mix_lengths(mix, entry, state["config"], model)
        flops = mix_flops(cfg, lengths)
        floor_s = sum(flops.values()) / (rate * 1e9)
        outputs = sum(o for _, o in lengths)
        floor_tps = outputs / floor_s
        medians = entry["summary"]["median"]
        peers = {e: t for e, t in medians.items() if not e.startswith(("virtual", "paged"))}
        best_peer = max(peers, key=peers.get) if peers else None
        mixes[mix] = {
            "flops": flops, "floor_s": floor_s, "floor_output_tok_s": floor_tps,
            "engines": {e: {"output_tok_s": t, "share_of_floor": t / floor_tps}
                        for e, t in medians.items()},
            "best_peer": best_peer,
            "floor_over_best_peer": floor_tps / peers[best_peer] if best_peer else None,
        }
        print(f"\n{mix}: {sum(flops.values()) / 1e12:.2f} TFLOP ("
              + ", ".join(f"{k} {v / 1e12:.2f}" for k, v in flops.items())
              + f"); floor {floor_s:.1f} s = {floor_tps:.1f} output tok/s")
        for e, t in medians.items():
            print(f"  {e:20s} {t:8.1f} tok/s  {t / floor_tps:6.1%} of the floor")
        if best_peer:
            print(f"  the floor / best peer ({best_peer}): "
                  f"{mixes[mix]['floor_over_best_peer']:.2f}x")
    return save({"bench": "flop_floor", "peers": str(args.peers), "dtype": args.dtype,
                 "rate_gflops": rate, "rate_rows": RATE_ROWS,
                 "threads": torch.get_num_threads(),
                 "machine": {"cpu": cpu_model(), "flags": [
                     f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16",
                                 "amx_bf16") if f in cpu_features().split()]},
                 "mixes": mixes}, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
