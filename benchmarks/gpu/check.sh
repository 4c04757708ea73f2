#!/usr/bin/env bash
# The GPU check (<= 420 s of steps on the H200): bash benchmarks/gpu/check.sh [--steps s3,s4] [--budget 420]
# Dry run on CPU: VMKV_CHECK_DEVICE=cpu bash benchmarks/gpu/check.sh
# Runs from the source tree (PYTHONPATH=.), installs nothing, writes to $OUT if set.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE
PY=""
for cand in "${PYTHON:-}" python3 python; do
  if [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1 && "$cand" -c "import torch" 2>/dev/null; then
    PY="$cand"; break
  fi
done
if [ -z "$PY" ]; then echo "check.sh: no python with torch found" >&2; exit 2; fi
exec "$PY" benchmarks/gpu/check.py "$@"
