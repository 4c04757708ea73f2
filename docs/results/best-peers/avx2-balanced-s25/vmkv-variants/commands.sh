# vmkv's weight formats and KV dtypes on the balanced mix (the peers' workload, written by
# best_peers.sh into /tmp/bp-avx2), virtual mode, fresh processes, session 25, AVX2 EPYC
cd /work/main
W=/tmp/bp-avx2/balanced/workload.jsonl
MODEL=$(.venv/bin/python -m vmkv.cli model fetch | tail -1)
declare -A V=( [A]="" [B]="--kv-cache-dtype int8" [C]="--quantization gguf" [D]="--quantization gguf --kv-cache-dtype int8" [E]="--quantization int8" )
# repetitions 0 and 1 ran `for v in A B C D E`, repetition 2 `for v in D C B A` (E left out)
for rep in 0 1 2; do for v in A B C D E; do
  OMP_NUM_THREADS=2 flock /tmp/vmkv-bench.lock .venv/bin/python -m vmkv.cli bench throughput --workload jsonl --jsonl $W --num-prompts 64 --kv-mode virtual --dtype float32 --model $MODEL --kv-cache-memory 4G --repeats 1 --warmup-prompts 8 --no-progress --json /tmp/var/$v-$rep.json ${V[$v]} > /tmp/var/$v-$rep.log 2>&1
  echo "$v $rep $(grep -E '^virtual' /tmp/var/$v-$rep.log | awk '{print $4}')"
done; done
