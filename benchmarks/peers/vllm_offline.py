"""Run vLLM offline on a vmkv workload file and print one JSON line of results.

Usage (inside the vLLM venv): python vllm_offline.py MODEL_DIR WORKLOAD.jsonl [--warmup N]

The workload is ``{"prompt": [token ids], "output_len": n}`` per line (``vmkv.bench.workloads``
writes it); every request is greedy with ``ignore_eos=True`` and ``max_tokens=output_len``, the
same work ``vmkv bench throughput --workload jsonl`` does. The first ``--warmup`` requests run
once before the timed ``generate`` of all of them (vLLM's ``bench throughput`` shape); the prefix
cache (on by default in both engines) is reset after the warm-up, as vmkv's bench does before
every repetition, so neither engine hits on the warm-up's prompts.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("workload")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=2048)
    args = ap.parse_args()
    with open(args.workload) as f:
        rows = [json.loads(line) for line in f if line.strip()]

    from vllm import LLM, SamplingParams

    started = time.monotonic()
    llm = LLM(model=args.model, dtype="float32", max_model_len=args.max_model_len, seed=0)
    init_s = time.monotonic() - started
    prompts = [{"prompt_token_ids": r["prompt"]} for r in rows]
    params = [SamplingParams(temperature=0.0, max_tokens=r["output_len"], ignore_eos=True)
              for r in rows]
    if args.warmup:
        llm.generate(prompts[: args.warmup], params[: args.warmup], use_tqdm=False)
    # prefix caching is on in both engines; start cold (the warm-up ran the first prompts)
    cache_reset = bool(llm.reset_prefix_cache())
    start = time.monotonic()
    outs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.monotonic() - start
    cached = sum(o.num_cached_tokens or 0 for o in outs)
    prompt_tokens = sum(len(r["prompt"]) for r in rows)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print("VLLM_RESULT " + json.dumps({
        "engine_init_s": init_s,
        "prefix_cache_reset": cache_reset,
        "cached_prompt_tokens": cached,
        "elapsed_s": elapsed,
        "num_requests": len(rows),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "requested_output_tokens": sum(r["output_len"] for r in rows),
        "requests_per_s": len(rows) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
    }))


if __name__ == "__main__":
    main()
