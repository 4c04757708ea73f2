#!/bin/bash
# before/after throughput, alternated: old (d8357b7) and new (HEAD), 3 processes each
set -u
export OMP_WAIT_POLICY=PASSIVE
ARGS="bench throughput --kv-mode both --num-prompts 32 --input-len 128 --output-len 64 --repeats 2 --warmup-prompts 4 --no-progress"
for i in 1 2 3; do
  for side in old new; do
    dir=/work/main; [ $side = old ] && dir=/work/wt-old
    (cd $dir && /work/main/.venv/bin/python -m vmkv.cli $ARGS --json /tmp/ab/$side-$i.json > /tmp/ab/$side-$i.log 2>&1)
    echo "$side $i rc=$?" >> /tmp/ab/progress
  done
done
echo done >> /tmp/ab/progress
