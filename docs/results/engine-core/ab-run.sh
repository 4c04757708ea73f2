#!/usr/bin/env bash
# Issue 27 throughput A/B: its base (26ac203) vs its branch tip (bab1d42), the refactor alone;
# balanced mix (seed 0, 9,358/9,388 tokens), fp32, both KV modes, fresh processes,
# alternated, 3 repetitions.
set -euo pipefail
OUT=/work/bench-out/ab27
W=/work/bench-out/best-peers/balanced/workload.jsonl
PY=/work/main/.venv/bin/python
export OMP_WAIT_POLICY=PASSIVE
for rep in 0 1 2; do
  for ver in before after; do
    dir=/work/wt-issue27; [ $ver = before ] && dir=/tmp/wt-before
    for mode in virtual paged; do
      (cd $dir && $PY -m vmkv.cli bench throughput --kv-mode $mode --dtype float32 \
        --workload jsonl --jsonl $W --num-prompts 64 --max-num-seqs 64 --kv-cache-memory 4GiB \
        --enable-prefix-caching --warmup-prompts 8 --repeats 1 --no-progress \
        --json $OUT/$ver-$mode-$rep.json) > $OUT/$ver-$mode-$rep.log 2>&1
      grep -E "^$mode " $OUT/$ver-$mode-$rep.log | tail -1
    done
  done
done
