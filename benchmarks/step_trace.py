"""Where an offline run's time goes, step by step: prefill steps vs decode steps by batch size.

    python benchmarks/step_trace.py WORKLOAD.jsonl [ENGINE FLAGS] [--json OUT.json]

Runs a workload file (``vmkv.bench.workloads`` format, e.g. the one ``benchmarks/peers/
vllm_cpu.sh`` writes) through one engine as ``vmkv bench throughput --workload jsonl`` does
(process tuned first, the first 8 requests as a warm-up, then the prefix cache reset so that
the timed run has no hits from it, greedy, exact output lengths; any
engine flag of ``vmkv bench throughput``, e.g. ``--kv-mode paged --dtype bfloat16
--kv-cache-memory 4G --no-precreate-pages``) and
records every step: sequences scheduled, tokens, milliseconds. Prints the time in steps that
carry prefill tokens and in pure decode steps, the latter by batch size in buckets of 8, so a
fixed per-step cost (weights streamed once per step) and a per-token cost can be read apart.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

from vmkv.process_tuning import tune_process

tune_process()  # before torch loads (OpenMP reads its settings once)

from vmkv.bench.workloads import BenchRequest, load_jsonl  # noqa: E402
from vmkv.config_args import add_engine_args, add_model_arg, engine_config  # noqa: E402
from vmkv.engine.llm_engine import LLMEngine  # noqa: E402
from vmkv.sampling_params import SamplingParams  # noqa: E402

Step = tuple[int, int, float]  # sequences scheduled, tokens, ms


def run(engine: LLMEngine, rows: list[BenchRequest], tag: str) -> tuple[float, list[Step]]:
    """All of ``rows`` to completion; (seconds, [(sequences, tokens, ms) per step])."""
    for i, row in enumerate(rows):
        engine.add_request(f"{tag}{i}", row.prompt_token_ids, SamplingParams(
            temperature=0.0, max_tokens=row.output_len, ignore_eos=True))
    steps: list[Step] = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        stats = engine.last_step  # what the step scheduled (public stats, not a wrapper)
        steps.append((stats.num_seqs, stats.num_tokens, (time.perf_counter() - t) * 1e3))
    return time.perf_counter() - start, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workload")
    ap.add_argument("--json", default=None)
    add_model_arg(ap)
    add_engine_args(ap)
    args = ap.parse_args()
    config = engine_config(args)
    engine = LLMEngine(config)
    rows = load_jsonl(args.workload, lambda text: engine.tokenizer(text).input_ids)  # as bench
    run(engine, rows[:8], "warmup-")
    engine.reset_prefix_cache()  # as bench throughput: the warm-up's prompts are not hits
    seconds, steps = run(engine, rows, "r")
    out_tokens = sum(r.output_len for r in rows)
    prefill = [s for s in steps if s[1] > s[0]]
    decode = [s for s in steps if s[1] == s[0]]
    buckets: dict[int, list[float]] = defaultdict(list)
    for seqs, _, ms in decode:
        buckets[(seqs + 7) // 8 * 8].append(ms)
    summary = {
        "kv_mode": config.kv_mode, "dtype": str(engine.executor.dtype),
        "precreate_pages": config.cache.precreate, "compiled": engine.executor.layers == "compiled",
        "fused_layers": engine.executor.layers == "fused", "seconds": seconds,
        "output_tokens_per_s": out_tokens / seconds, "steps": len(steps),
        "prefill_steps": len(prefill), "prefill_s": sum(s[2] for s in prefill) / 1e3,
        "prefill_tokens": sum(s[1] for s in prefill),
        "decode_steps": len(decode), "decode_s": sum(s[2] for s in decode) / 1e3,
        "decode_by_batch": {f"<={b}": {"steps": len(ms), "ms_per_step": sum(ms) / len(ms)}
                            for b, ms in sorted(buckets.items())},
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**summary, "trace": steps}, f)


if __name__ == "__main__":
    main()
