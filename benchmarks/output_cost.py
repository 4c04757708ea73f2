"""The engine's own per-step cost as outputs grow: ``engine_python`` (the profiler's part: a
step's time less the executor's forward and the sampler) at output lengths 100 and 8,000,
batch 1 and 32, for the server's DELTA outputs and for CUMULATIVE ones (every step a copy of
the whole output: what every request cost before outputs were deltas).

    python benchmarks/output_cost.py [--lengths 100 8000] [--batches 1 32] [--json OUT.json]

The model is a stand-in executor (real KV manager, paged, a few bytes per token; logits that
cycle through ordinary text tokens), so the numbers are the engine's alone: scheduler, KV
calls, step plan, sampler input, append, detokenise, stop checks, outputs. Per request
``logprobs=1`` and a stop string, so every part of the output path runs. Each point is the
median over the 20 steps after the outputs reached the length.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from vmkv.config import CacheConfig, EngineConfig
from vmkv.engine.llm_engine import LLMEngine
from vmkv.executor.base import Executor, StepOutput
from vmkv.executor.plan import StepPlan
from vmkv.kv import KVSpec, create_kv_cache
from vmkv.models import load_model_config, load_tokenizer, resolve_model
from vmkv.sampling_params import RequestOutputKind, SamplingParams

MEASURED_STEPS = 20
SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=2)


class CyclingExecutor(Executor):
    """Logits whose argmax cycles through token ids 1000..1096 (ordinary text pieces)."""

    def __init__(self, config: EngineConfig) -> None:
        path = resolve_model(None)
        self.model_config = load_model_config(path)
        self.kv = create_kv_cache(CacheConfig(kv_mode="paged", kv_cache_memory=(
            config.max_num_seqs * config.max_model_len * SPEC.bytes_per_token),
            enable_prefix_caching=False), SPEC, num_slots=config.max_num_seqs,
            max_model_len=config.max_model_len)
        self.model_name, self.max_model_len, self.dtype = "stand-in", config.max_model_len, (
            torch.float32)

    def execute(self, plan: StepPlan) -> StepOutput:
        if not plan.sample_rows:
            return StepOutput(None, [])
        logits = torch.zeros(len(plan.sample_rows), self.model_config.vocab_size)
        for i, row in enumerate(plan.sample_rows):
            logits[i, 1000 + (plan.positions[row] * 7) % 97] = 10.0
        return StepOutput(logits, [])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def measure(batch: int, length: int, kind: RequestOutputKind, tokenizer: object) -> float:
    """Median engine_python ms of the steps after every request has ``length`` outputs."""
    config = EngineConfig(max_model_len=length + MEASURED_STEPS + 64, max_num_seqs=batch,
                          max_num_batched_tokens=max(2048, batch * 16))
    engine = LLMEngine(config, executor=CyclingExecutor(config), tokenizer=tokenizer)
    params = SamplingParams(temperature=0, max_tokens=length + MEASURED_STEPS, ignore_eos=True,
                            logprobs=1, stop=["NEVER-MATCHES"], output_kind=kind)
    for i in range(batch):
        engine.add_request(f"r{i}", [1, 504, 3458, 282, 4649, 314 + i], params)
    samples = []
    while engine.has_unfinished_requests():
        engine.step()
        outputs = engine.scheduler.running[0].num_output_tokens if engine.scheduler.running \
            else 0
        if outputs > length:
            s = engine.last_step
            samples.append((s.total_ns - s.execute_ns - s.sample_ns) / 1e6)
    engine.close()
    return statistics.median(samples[:MEASURED_STEPS])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[100, 8000])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    tokenizer = load_tokenizer(resolve_model(None))
    rows = []
    for batch in args.batches:
        for length in args.lengths:
            for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
                started = time.monotonic()
                ms = measure(batch, length, kind, tokenizer)
                rows.append({"batch": batch, "output_len": length, "kind": kind.name,
                             "engine_python_ms": ms})
                print(f"batch {batch:3d}  output {length:5d}  {kind.name:10s}  "
                      f"engine_python {ms:8.3f} ms/step  ({time.monotonic() - started:.0f} s)",
                      flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
