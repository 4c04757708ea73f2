#!/bin/sh
# DP=1 (one in-process engine, 2 threads) and DP=2 (two replica processes, 1 thread each) on
# the same workload, on the 2-core CPU machine, alternated in fresh processes (1 2 1 2);
# compiled decoder layers (the default), 4 warm-up requests, 3 measured repetitions each.
set -e
cd "$(dirname "$0")"
for round in ${ROUNDS:-1 2}; do
  for n in 1 2; do
    vmkv bench throughput --data-parallel-size "$n" --num-prompts 32 --input-len 128 \
        --output-len 64 --max-model-len 512 --seed 0 --repeats 3 --warmup-prompts 4 \
        --no-progress --json "dp$n-round$round.json"
  done
done
