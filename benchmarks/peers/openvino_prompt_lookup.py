"""OpenVINO GenAI's prompt-lookup decoding on one user: each prompt of a workload file alone
(batch 1), greedy, up to its output length, stopped at EOS unless the row says
``"ignore_eos": true`` (the default when absent: exactly its output length); prints
``RESULT {json}`` with the per-prompt time per output token from OpenVINO's own
``perf_metrics`` (``get_tpot``).

Usage (inside the OpenVINO venv, benchmarks/peers/setup.sh ``ensure_openvino_venv``; the model
from ``ensure_openvino_model``), as benchmarks/spec_decode.py runs it:

    python openvino_prompt_lookup.py OV_MODEL_DIR WORKLOAD.json --threads 2 \
        [--num-assistant-tokens 5] [--max-ngram-size 4] [--precision bf16]

WORKLOAD.json: a list of ``{"prompt": [ids], "output_len": n, "ignore_eos": bool}`` (the same
token ids vmkv runs). The first prompt also runs once as a warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("workload")
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--num-assistant-tokens", type=int, default=5)
    ap.add_argument("--max-ngram-size", type=int, default=4)
    ap.add_argument("--precision", choices=("f32", "bf16"), default="bf16")
    args = ap.parse_args()
    with open(args.workload) as f:
        rows = json.load(f)

    import numpy as np
    import openvino as ov
    import openvino_genai as og

    pipe = og.LLMPipeline(args.model, "CPU", prompt_lookup=True,
                          INFERENCE_NUM_THREADS=args.threads,
                          INFERENCE_PRECISION_HINT=args.precision)

    def one(row: dict) -> tuple[float, list[int]]:
        config = pipe.get_generation_config()  # the export's EOS ids
        config.do_sample = False
        config.ignore_eos = row.get("ignore_eos", True)
        config.max_new_tokens = row["output_len"]
        config.min_new_tokens = row["output_len"] if config.ignore_eos else 0
        config.num_assistant_tokens = args.num_assistant_tokens
        config.max_ngram_size = args.max_ngram_size
        res = pipe.generate(ov.Tensor(np.asarray([row["prompt"]], dtype=np.int64)), config)
        return res.perf_metrics.get_tpot().mean, list(res.tokens[0])

    one(rows[0])
    tpots, outputs = [], []
    for row in rows:
        tpot, tokens = one(row)
        tpots.append(tpot)
        outputs.append(tokens)
    print("RESULT " + json.dumps({
        "tpot_ms": tpots, "tpot_median_ms": statistics.median(tpots), "outputs": outputs,
        "settings": {"num_assistant_tokens": args.num_assistant_tokens,
                     "max_ngram_size": args.max_ngram_size, "precision": args.precision,
                     "threads": args.threads},
        "versions": {"openvino": ov.__version__, "openvino_genai": og.__version__}}))


if __name__ == "__main__":
    main()
