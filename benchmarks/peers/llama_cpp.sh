# Sourced by the peer scripts: llama.cpp built natively for this CPU, once.
#   ensure_llama_cpp     -> $LLAMA_CPP_BIN (llama-bench, llama-cli, llama-server)
#
# The source is llama.cpp as vendored in llama-cpp-python's source distribution on PyPI (pip
# is the registry these machines reach; the sdist holds the whole llama.cpp tree at the commit
# that release pins), built with cmake -DGGML_NATIVE=ON (-march=native: AVX-512 VNNI, BF16 where
# the CPU has them) and without curl, the way a user who builds llama.cpp for their own CPU gets
# it at its best. Nothing of llama.cpp is committed to vmkv; the build lives in ~/.cache/vmkv.
LLAMA_CPP_PY_VERSION=${LLAMA_CPP_PY_VERSION:-0.3.36}
LLAMA_CPP_HOME=${LLAMA_CPP_HOME:-$HOME/.cache/vmkv/llama.cpp-$LLAMA_CPP_PY_VERSION}
LLAMA_CPP_BIN=$LLAMA_CPP_HOME/build/bin

ensure_llama_cpp() {
    if [ -x "$LLAMA_CPP_BIN/llama-server" ] && [ -x "$LLAMA_CPP_BIN/llama-bench" ]; then
        return
    fi
    local tmp
    tmp=$(mktemp -d)
    python3 -m pip download -q --no-binary :all: --no-deps \
        "llama-cpp-python==$LLAMA_CPP_PY_VERSION" -d "$tmp" >&2
    mkdir -p "$LLAMA_CPP_HOME"
    tar -xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
    rm -rf "$LLAMA_CPP_HOME/src"
    mv "$tmp"/llama_cpp_python-*/vendor/llama.cpp "$LLAMA_CPP_HOME/src"
    rm -rf "$tmp"
    cmake -S "$LLAMA_CPP_HOME/src" -B "$LLAMA_CPP_HOME/build" -G Ninja \
        -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >&2
    cmake --build "$LLAMA_CPP_HOME/build" -j "$(nproc)" \
        --target llama-bench llama-cli llama-server >&2
    "$LLAMA_CPP_BIN/llama-cli" --version >&2 || true
}
