"""``vmkv bench startup``: from process start to the first generated token, in a fresh process.

A child Python process tunes itself as ``vmkv serve`` does, imports vmkv, builds the engine with
the given options (model cached) and runs one 8-token prompt for one token. The parent takes the
time before spawning the child; the child reports wall-clock (``time.time()``) timestamps of
each stage, so

    spawn -> imports done -> engine built -> first token

are all measured from the parent's spawn (interpreter start-up included).

A CPU engine's start depends on its on-disk caches: TorchInductor's for compiled layers and
vmkv's built kernels (``$VMKV_BUILD_DIR``) for fused ones and the attention kernels. So every
run names its own ``TORCHINDUCTOR_CACHE_DIR`` and ``VMKV_BUILD_DIR``: **cold** runs get empty
ones (a first start on a new machine), **warm** runs share ones filled by an unrecorded run
first (a restart). Cold and warm runs alternate.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from vmkv import envs

_CHILD = """
import json, sys, time
t = {"start": time.time()}
import argparse
from vmkv.process_tuning import tune_process
tune_process()
from vmkv.config_args import add_engine_args, add_model_arg, engine_config
from vmkv.engine.llm_engine import LLMEngine
from vmkv.sampling_params import SamplingParams
t["imports"] = time.time()
p = argparse.ArgumentParser()
add_model_arg(p)
add_engine_args(p)
engine = LLMEngine(engine_config(p.parse_args(sys.argv[1:])))
t["engine"] = time.time()
engine.add_request("probe", [1] * 8, SamplingParams(temperature=0.0, max_tokens=1,
                                                    ignore_eos=True))
while engine.has_unfinished_requests():
    engine.step()
t["first_token"] = time.time()
t["layers"] = engine.executor.layers  # fused, compiled or eager
print("VMKV_STARTUP " + json.dumps(t))
"""

def measure_once(engine_argv: Sequence[str], timeout: float = 600.0,
                 env: dict[str, str] | None = None) -> dict[str, float]:
    """Seconds from spawn to each stage (cumulative) for one fresh process, and how its engine
    ran the decoder layers: fused, compiled or eager (an engine that fell back to eager starts
    faster and runs slower)."""
    spawned = time.time()
    proc = subprocess.run([sys.executable, "-c", _CHILD, *engine_argv], capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                          env=envs.child_environment(**(env or {})))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("VMKV_STARTUP ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"start-up probe failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    t = json.loads(lines[-1].removeprefix("VMKV_STARTUP "))
    return {"interpreter_s": t["start"] - spawned, "imports_s": t["imports"] - spawned,
            "engine_s": t["engine"] - spawned, "first_token_s": t["first_token"] - spawned,
            "layers": t["layers"]}


CACHES = ("cold", "warm")


def run(engine_argv: Sequence[str], *, repeats: int = 3,
        caches: Sequence[str] = CACHES) -> dict[str, Any]:
    """``repeats`` fresh processes per compile cache state (alternated); rows and medians."""
    if repeats <= 0:
        raise ValueError(f"repeats must be positive, got {repeats}")
    unknown = set(caches) - set(CACHES)
    if unknown or not caches:
        raise ValueError(f"caches must be among {CACHES}, got {list(caches)}")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="vmkv-startup-") as tmp:
        def caches_at(folder: str) -> dict[str, str]:
            return {"TORCHINDUCTOR_CACHE_DIR": os.path.join(folder, "inductor"),
                    "VMKV_BUILD_DIR": os.path.join(folder, "csrc")}

        warm = os.path.join(tmp, "warm")
        if "warm" in caches:  # fill the shared caches (not recorded)
            measure_once(engine_argv, env=caches_at(warm))
        for i in range(repeats):
            for cache in caches:
                folder = warm if cache == "warm" else os.path.join(tmp, f"cold-{i}")
                rows.append({"cache": cache, "run": i,
                             **measure_once(engine_argv, env=caches_at(folder))})
    median = {cache: {**{k: statistics.median(r[k] for r in rows if r["cache"] == cache)
                         for k in COLUMNS[2:-1]},
                      "layers": "/".join(sorted({r["layers"] for r in rows
                                                 if r["cache"] == cache}))}
              for cache in caches}
    return {"engine_argv": list(engine_argv),
            "rows": [*rows, *({"cache": c, "run": "median", **m} for c, m in median.items())],
            "median": median}


COLUMNS = ("cache", "run", "interpreter_s", "imports_s", "engine_s", "first_token_s", "layers")
