"""Tensor parallelism on the CPU: 1 rank against N ranks of one model, alternated, fresh
processes, one run.

    python benchmarks/tensor_parallel_cpu.py --out DIR [--model DIR] [--sizes 1,2]
        [--kv-mode virtual] [--repeats 3] [--num-prompts 32] [--input-len 128] [--output-len 128]

Without ``--model`` the model is a random-weight Llama of SmolLM2-135M's size (30 layers,
hidden 512, MLP 1536, 49k vocabulary) with 8 heads and 4 KV heads, which split over 2 ranks
(SmolLM2's own 9 heads split only over 3), written once to ``DIR/model`` with the default
model's tokenizer. Every repetition runs ``vmkv bench throughput --tensor-parallel-size N
--repeats 1`` once per size in a fresh process, in rotating order; each process warms up on
the first 8 requests. Writes ``tensor_parallel.json`` (every run, medians, the N-rank / 1-rank
ratio per repetition) and ``tensor_parallel.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bench_model(folder: Path) -> Path:
    """The random-weight 8-head model (written once) with the default model's tokenizer."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from vmkv.models import resolve_model

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=512, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=2048, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    default = resolve_model(None, progress=False)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default / name, folder / name)
    return folder


def run_one(args: argparse.Namespace, model: Path, size: int, rep: int) -> dict:
    out = args.out / f"tp{size}-{rep}.json"
    cmd = [sys.executable, "-m", "vmkv.cli", "bench", "throughput", "--model", str(model),
           "--kv-mode", args.kv_mode, "--tensor-parallel-size", str(size), "--repeats", "1",
           "--workload", "random", "--num-prompts", str(args.num_prompts),
           "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--max-model-len", "1024", "--no-progress", "--json", str(out)]
    with (args.out / f"tp{size}-{rep}.log").open("w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True, cwd=ROOT)
    result = json.loads(out.read_text())
    run = result["runs"][0]
    return {"size": size, "repeat": rep, "output_tokens_per_s": run["output_tokens_per_s"],
            "startup_s": result["startup"][args.kv_mode]["engine_init_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--sizes", default="1,2")
    parser.add_argument("--kv-mode", default="virtual", choices=("virtual", "paged"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.model or bench_model(args.out / "model")
    sizes = [int(s) for s in args.sizes.split(",")]
    runs = []
    for rep in range(args.repeats):
        order = sizes[rep % len(sizes):] + sizes[: rep % len(sizes)]
        for size in order:
            runs.append(run_one(args, model, size, rep))
            print(json.dumps(runs[-1]), flush=True)
    by = {(r["size"], r["repeat"]): r["output_tokens_per_s"] for r in runs}
    medians = {s: statistics.median(by[s, i] for i in range(args.repeats)) for s in sizes}
    ratios = {s: [by[s, i] / by[sizes[0], i] for i in range(args.repeats)] for s in sizes[1:]}
    doc = {"bench": "tensor_parallel_cpu", "model": str(model), "kv_mode": args.kv_mode,
           "workload": vars(args) | {"out": str(args.out), "model": str(model)},
           "runs": runs, "median_output_tokens_per_s": medians, "ratio_to_first_size": ratios,
           "ratio_median": {s: statistics.median(r) for s, r in ratios.items()}}
    (args.out / "tensor_parallel.json").write_text(json.dumps(doc, indent=1))
    print(json.dumps({"medians": medians, "ratio_median": doc["ratio_median"]}))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar([str(s) for s in sizes], [medians[s] for s in sizes])
    for s in sizes:
        ax.scatter([str(s)] * args.repeats, [by[s, i] for i in range(args.repeats)],
                   color="black", s=10, zorder=3)
    ax.set_xlabel("tensor-parallel ranks")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{args.kv_mode}, {args.num_prompts} prompts, one machine")
    fig.tight_layout()
    fig.savefig(args.out / "tensor_parallel.png", dpi=120)


if __name__ == "__main__":
    main()
