"""``vmkv bench startup``: from process start to the first generated token, in a fresh process.

A child Python process tunes itself as ``vmkv serve`` does, imports vmkv, builds the engine with
the given options (model cached) and runs one 8-token prompt for one token. The parent takes the
time before spawning the child; the child reports wall-clock (``time.time()``) timestamps of
each stage, so

    spawn -> imports done -> engine built -> first token

are all measured from the parent's spawn (interpreter start-up included).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

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
print("VMKV_STARTUP " + json.dumps(t))
"""

def measure_once(engine_argv: Sequence[str], timeout: float = 600.0) -> dict[str, float]:
    """Seconds from spawn to each stage (cumulative) for one fresh process."""
    spawned = time.time()
    proc = subprocess.run([sys.executable, "-c", _CHILD, *engine_argv], capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("VMKV_STARTUP ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"start-up probe failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    t = json.loads(lines[-1].removeprefix("VMKV_STARTUP "))
    return {"interpreter_s": t["start"] - spawned, "imports_s": t["imports"] - spawned,
            "engine_s": t["engine"] - spawned, "first_token_s": t["first_token"] - spawned}


def run(engine_argv: Sequence[str], *, repeats: int = 3) -> dict[str, Any]:
    """``repeats`` fresh processes; rows of each and the medians."""
    if repeats <= 0:
        raise ValueError(f"repeats must be positive, got {repeats}")
    rows = [{"run": i, **measure_once(engine_argv)} for i in range(repeats)]
    median = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "run"}
    return {"engine_argv": list(engine_argv), "rows": [*rows, {"run": "median", **median}],
            "median": median}


COLUMNS = ("run", "interpreter_s", "imports_s", "engine_s", "first_token_s")
