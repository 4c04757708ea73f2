"""Step 5 (runs last, only with time left): the benchmark CLI on the GPU: ``vmkv bench
throughput --kv-mode both`` on a Llama-3.2-1B-shaped random-weight checkpoint (bf16, 3 GB
written here: no network, no gguf; 8B shapes would not fit the time left) and ``vmkv bench
kernels`` (its CUDA half: the Triton twins).

The commands are the CLI's own (``python -m vmkv.cli bench ...``) in child processes; their
JSON lands next to this step's. ``VMKV_CHECK_DEVICE=cpu`` runs a tiny dry run on CPU.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common import (
    DEVICE,
    LLAMA32_1B,
    ON_CPU,
    ROOT,
    WORK,
    Result,
    fast_scratch,
    run_step,
    save_random_checkpoint,
    save_word_tokenizer,
    step_budget,
    tiny_llama_config,
)

BUDGET_S = step_budget(95)
WRITE_BUDGET_S = 20.0
OUT = Path(os.environ.get("VMKV_CHECK_OUT", ROOT / "benchmarks" / "results"))


def cli(res: Result, name: str, args: list[str], timeout: float) -> dict | None:
    """Run ``vmkv <args>``; returns its JSON (``--json``) or None, recording the outcome."""
    out = OUT / f"{name}.json"
    log = OUT / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "vmkv.cli", *args, "--json", str(out)]
    start = time.monotonic()
    try:
        with log.open("w") as f:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                                  cwd=ROOT)
        rc: int | str = proc.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    tail = log.read_text()[-1500:] if log.exists() else ""
    res.check(f"vmkv {' '.join(args[:2])}", rc == 0, rc=rc, seconds=time.monotonic() - start,
              command=" ".join(cmd), log_tail=tail if rc != 0 else "")
    if rc == 0 and out.exists():
        return json.loads(out.read_text())
    return None


def slowest_steps(result: dict) -> dict[str, dict[str, float]]:
    """Each mode's slowest step (ms, its index) and median step from the runs' step traces
    (``trace.t``: seconds since the run's start after each step). A step far above its
    neighbours is a stall inside the run: the first H200 runs had paged's second step at
    457-716 ms among 49-66 ms prefills, a Triton recompile at a new block-table width."""
    out: dict[str, dict[str, float]] = {}
    for run in result.get("runs", []):
        t = (run.get("trace") or {}).get("t") or []
        steps = [(b - a) * 1e3 for a, b in zip([0.0, *t[:-1]], t, strict=True)]
        if not steps:
            continue
        worst = max(range(len(steps)), key=steps.__getitem__)
        out[run["mode"]] = {"ms": steps[worst], "step": worst,
                            "median_ms": sorted(steps)[len(steps) // 2]}
    return out


def main(res: Result) -> None:
    import transformers

    start = time.monotonic()
    if ON_CPU:
        cfg = tiny_llama_config()
        path = WORK / "tiny-shaped"
        workload = ["--num-prompts", "8", "--input-len", "16", "--output-len", "4",
                    "--max-num-seqs", "4", "--max-model-len", "64", "--kv-cache-memory", "64M"]
    else:
        cfg = transformers.LlamaConfig(**LLAMA32_1B)
        path = fast_scratch(8 << 30) / "llama32-1b-shaped"
        workload = ["--num-prompts", "128", "--input-len", "256", "--output-len", "32",
                    "--max-num-seqs", "128", "--max-num-batched-tokens", "8192",
                    "--max-model-len", "512", "--kv-cache-memory", "8G"]
    if not (path / "model.safetensors.index.json").exists():
        try:
            secs = save_random_checkpoint(cfg, path, device=DEVICE,
                                          deadline=start + WRITE_BUDGET_S)
        except TimeoutError:  # slow disk: same shapes, a quarter of the layers
            shutil.rmtree(path, ignore_errors=True)
            cfg.num_hidden_layers = max(1, cfg.num_hidden_layers // 4)
            path = path.with_name(path.name + f"-{cfg.num_hidden_layers}layers")
            secs = save_random_checkpoint(cfg, path, device=DEVICE)
            res.record("note", f"disk too slow for the checkpoint in {WRITE_BUDGET_S:.0f} s: "
                       f"{cfg.num_hidden_layers} of {LLAMA32_1B['num_hidden_layers']} layers")
        save_word_tokenizer(path, cfg.vocab_size)
        res.record("checkpoint_write_s", secs)
    res.record("model_dir", str(path))
    left = lambda: BUDGET_S - (time.monotonic() - start)  # noqa: E731
    result = cli(res, "bench_throughput",
                 ["bench", "throughput", "--model", str(path), "--device", DEVICE,
                  "--dtype", "bfloat16", "--kv-mode", "both", "--workload", "random",
                  *workload, "--repeats", "1", "--warmup-prompts", "4", "--no-progress"],
                 timeout=max(10.0, left() - 25))
    if result is not None:
        res.record("throughput_summary", result.get("summary"))
        slowest = slowest_steps(result)
        res.record("slowest_steps", slowest)
        summary = result.get("summary") or {}
        if "virtual" in summary and "paged" in summary:
            v, p = (summary[m].get("output_tokens_per_s", 0) for m in ("virtual", "paged"))
            res.headline = f"throughput virtual {v:.0f} vs paged {p:.0f} output tok/s"
            if all(m in slowest for m in ("virtual", "paged")):
                res.headline += (f"; slowest step {slowest['virtual']['ms']:.0f} / "
                                 f"{slowest['paged']['ms']:.0f} ms")
    kern = ["bench", "kernels", "--batch-sizes", "1,32,128", "--context-lens", "1024,16384",
            "--max-tokens", "0", "--phases", "decode,prefill", "--repeats", "5",
            "--warmup", "2", "--no-progress"]
    if ON_CPU:
        kern = ["bench", "kernels", "--batch-sizes", "1", "--context-lens", "64",
                "--max-tokens", "64", "--phases", "decode", "--repeats", "1", "--warmup", "0",
                "--no-progress", "--no-cuda"]
    result = cli(res, "bench_kernels", kern, timeout=max(10.0, left()))
    if result is not None:
        res.record("kernels_rows", len(result.get("rows", [])))


if __name__ == "__main__":
    run_step("s5_bench_cli", main)
