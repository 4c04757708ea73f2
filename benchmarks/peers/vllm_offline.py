"""Run vLLM offline on a vmkv workload file and print one ``PEER_RESULT {json}`` line.

Usage (inside the vLLM venv): python vllm_offline.py MODEL_DIR WORKLOAD.jsonl
    [--dtype float32|bfloat16] [--warmup N]

The workload is ``{"prompt": [token ids], "output_len": n}`` per line (``vmkv.bench.workloads``
writes it); every request is greedy with ``ignore_eos=True`` and ``max_tokens=output_len``, the
same work ``vmkv bench throughput --workload jsonl`` does. The first ``--warmup`` requests run
once before the timed ``generate`` of all of them (vLLM's ``bench throughput`` shape); the prefix
cache (on by default in both engines) is reset after the warm-up, as vmkv's bench does before
every repetition, so neither engine hits on the warm-up's prompts. The KV cache size and thread
binding come from the environment (``VLLM_CPU_KVCACHE_SPACE``, ``VLLM_CPU_OMP_THREADS_BIND``:
``compare.py`` sets them).
"""

from __future__ import annotations

import argparse
import time

from peer_result import exactness, print_result, read_workload


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("workload")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="vLLM's flag (fp8: an 8-bit KV cache, where its CPU backend takes one)")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="default: 2,048, or the workload's longest request if longer")
    args = ap.parse_args()
    rows = read_workload(args.workload)
    longest = max(len(r["prompt"]) + r["output_len"] for r in rows)
    args.max_model_len = args.max_model_len or max(2048, longest)

    import torch
    import vllm
    from vllm import LLM, SamplingParams

    started = time.monotonic()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=0,
              kv_cache_dtype=args.kv_cache_dtype)
    init_s = time.monotonic() - started
    prompts = [{"prompt_token_ids": r["prompt"]} for r in rows]
    params = [SamplingParams(temperature=0.0, max_tokens=r["output_len"], ignore_eos=True)
              for r in rows]
    if args.warmup:
        llm.generate(prompts[: args.warmup], params[: args.warmup], use_tqdm=False)
    # prefix caching is on in both engines; start cold (the warm-up ran the first prompts)
    cache_reset = bool(llm.reset_prefix_cache())
    start = time.monotonic()
    outs = llm.generate(prompts, params, use_tqdm=False)
    generate_s = time.monotonic() - start
    print_result({
        "engine_init_s": init_s,
        "generate_s": generate_s,
        **exactness(rows, [len(o.outputs[0].token_ids) for o in outs]),
        "prefix_cache_reset": cache_reset,
        "cached_prompt_tokens": sum(o.num_cached_tokens or 0 for o in outs),
        "settings": {"dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype,
                     "max_model_len": args.max_model_len,
                     **scheduler_settings(llm)},
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
    })


def scheduler_settings(llm) -> dict:
    """The batch limits vLLM chose for this machine (empty where its internals moved)."""
    try:
        config = llm.llm_engine.vllm_config.scheduler_config
        return {"max_num_seqs": config.max_num_seqs,
                "max_num_batched_tokens": config.max_num_batched_tokens}
    except AttributeError:
        return {}


if __name__ == "__main__":
    main()
