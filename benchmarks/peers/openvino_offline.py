"""Run OpenVINO GenAI's ``ContinuousBatchingPipeline`` on a vmkv workload file; print one
``PEER_RESULT {json}`` line.

Usage (inside the OpenVINO venv, ``benchmarks/peers/setup.sh``):

    python openvino_offline.py OV_MODEL_DIR WORKLOAD.jsonl --precision f32|bf16 [--threads 2]

``OV_MODEL_DIR`` is the default model exported by ``optimum-cli export openvino --weight-format
fp32`` (``openvino_export.py``); the precision is a runtime hint, as OpenVINO users set it:
``INFERENCE_PRECISION_HINT`` and ``KV_CACHE_PRECISION`` (OpenVINO's own default on a bf16 CPU is
bf16 compute with a u8 KV cache). Every request is greedy, ``ignore_eos``, with
``min_new_tokens = max_new_tokens = output_len``, fed as token ids (no tokenizer round trip):
the work ``vmkv bench throughput --workload jsonl`` does. The first ``--warmup`` requests run
once before the timed ``generate`` of all of them. Prefix caching stays at OpenVINO's default
(off); the random prompts share nothing, and the warm-up's prompts could not be hit again.
"""

from __future__ import annotations

import argparse
import time

from peer_result import exactness, print_result, read_workload


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("workload")
    ap.add_argument("--precision", choices=("f32", "bf16", "u8kv", "default"), required=True,
                    help="f32 / bf16: compute and KV; u8kv: bf16 compute over a u8 KV cache; "
                         "default: no precision hints (OpenVINO's own choice)")
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--kv-cache-gib", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=8)
    args = ap.parse_args()
    rows = read_workload(args.workload)

    import openvino as ov
    import openvino_genai as og

    scheduler = og.SchedulerConfig()
    scheduler.cache_size = args.kv_cache_gib  # GiB
    scheduler.max_num_seqs = args.max_num_seqs
    scheduler.max_num_batched_tokens = args.max_num_batched_tokens
    scheduler.dynamic_split_fuse = True  # chunked prefill, as vLLM and vmkv
    hints = {"f32": ("f32", "f32"), "bf16": ("bf16", "bf16"), "u8kv": ("bf16", "u8")}
    properties: dict = {"INFERENCE_NUM_THREADS": args.threads}
    if args.precision in hints:
        compute, kv = hints[args.precision]
        properties.update(INFERENCE_PRECISION_HINT=compute, KV_CACHE_PRECISION=kv)
    started = time.monotonic()
    pipe = og.ContinuousBatchingPipeline(args.model, scheduler, "CPU", properties)
    init_s = time.monotonic() - started

    prompts = [ov.Tensor(ids_array(r["prompt"])) for r in rows]
    configs = [generation_config(og, r["output_len"]) for r in rows]
    if args.warmup:
        pipe.generate(prompts[: args.warmup], configs[: args.warmup])
    start = time.monotonic()
    results = pipe.generate(prompts, configs)
    generate_s = time.monotonic() - start
    lengths = [len(r.m_generation_ids[0]) for r in results]
    print_result({
        "engine_init_s": init_s,
        "generate_s": generate_s,
        **exactness(rows, lengths),
        "settings": {"properties": properties, "scheduler": {
            "cache_size_gib": scheduler.cache_size, "max_num_seqs": scheduler.max_num_seqs,
            "max_num_batched_tokens": scheduler.max_num_batched_tokens,
            "dynamic_split_fuse": scheduler.dynamic_split_fuse,
            "enable_prefix_caching": scheduler.enable_prefix_caching}},
        "versions": {"openvino": ov.__version__, "openvino_genai": og.__version__},
    })


def ids_array(prompt: list[int]):
    """``prompt`` as the int64 ``[1, n]`` array OpenVINO GenAI takes for token ids."""
    import numpy as np

    return np.asarray([prompt], dtype=np.int64)  # [1, n]


def generation_config(og, output_len: int):
    """Greedy, EOS ignored, exactly ``output_len`` new tokens."""
    config = og.GenerationConfig()
    config.do_sample = False
    config.ignore_eos = True
    config.max_new_tokens = output_len
    config.min_new_tokens = output_len
    return config


if __name__ == "__main__":
    main()
