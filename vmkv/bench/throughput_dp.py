"""``vmkv bench throughput --data-parallel-size N``: the offline workload through N replica
processes (:class:`~vmkv.engine.data_parallel.DataParallelEngine`), driven with asyncio.

Every request is queued at once, as ``bench throughput`` does for one engine, and the router
spreads them (least loaded; the prefix-sticky rule keeps a shared prefix on one replica).
Throughput and latency come from the outputs as for one engine
(:func:`~vmkv.bench.throughput.summarise_outputs`); preemptions and recomputed tokens are the
replicas' summed counters before and after each run; ``router_cpu_s`` is the CPU time of this
process (router, pipes, streams) during the run, which the replicas do not get. KV memory is
not sampled per step (the engines are in other processes): those columns stay empty. With
prefix caching on, every replica's cache is reset before each repetition.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from vmkv.bench.common import progress_bar
from vmkv.bench.throughput import params_for, summarise_outputs, summarise_runs
from vmkv.bench.workloads import BenchRequest
from vmkv.config import EngineConfig
from vmkv.engine.data_parallel import DataParallelEngine
from vmkv.engine.llm_engine import LLMEngine
from vmkv.engine.outputs import RequestOutput
from vmkv.engine.snapshot import Snapshot, combine, take_snapshot


def mode_name(config: EngineConfig) -> str:
    """The run's name in the table, e.g. ``virtual dp=2``."""
    return f"{config.kv_mode} dp={config.data_parallel_size}"


async def _counters(engine: DataParallelEngine) -> Snapshot:
    return combine(await engine.call_all(take_snapshot))


async def _first_token(engine: DataParallelEngine) -> None:
    """One 1-token request (a cold first token, as ``throughput.build_engine`` runs)."""
    prompt = [engine.front.tokenizer.bos_token_id or 1] * 8
    async for _ in await engine.add("bench-probe", prompt, params_for(1)):
        pass


async def run_once(engine: DataParallelEngine, requests: Sequence[BenchRequest], *, tag: str,
                   progress: bool = True) -> dict[str, Any]:
    """Queue every request, wait for every final output; the run's numbers."""
    before = await _counters(engine)
    bar = progress_bar(progress, tag, total=len(requests))

    async def final(stream: Any) -> RequestOutput:
        async for out in stream:
            last = out
        bar.update(1)
        return last

    start, cpu_start = time.monotonic(), time.process_time()
    streams = [await engine.add(f"{tag}-{i}", r.prompt_token_ids, params_for(r.output_len))
               for i, r in enumerate(requests)]
    outs = await asyncio.gather(*(final(s) for s in streams))
    elapsed, cpu = time.monotonic() - start, time.process_time() - cpu_start
    bar.close()
    after = await _counters(engine)
    result = summarise_outputs(requests, list(outs), elapsed, start)
    result.update(
        preemptions=after.preemptions - before.preemptions,
        recomputed_tokens=after.recomputed_tokens - before.recomputed_tokens,
        peak_kv_bytes_in_use=None, peak_kv_bytes_held=None, mean_kv_bytes_in_use=None,
        kv_useful_fraction=None, map_stall_s=None, minor_faults=None, wall_s=elapsed,
        router_cpu_s=cpu,
        trace={"t": [], "bytes_in_use": [], "token_bytes": []})
    return result


def run(config: EngineConfig, requests: Sequence[BenchRequest], *, repeats: int = 3,
        warmup_prompts: int = 8, progress: bool = True) -> dict[str, Any]:
    """Start the replicas, warm them up, run the workload ``repeats`` times, stop them.

    Returns ``{"startup", "runs", "summary"}`` shaped as :func:`vmkv.bench.throughput.run`'s.
    """
    if repeats <= 0:
        raise ValueError(f"repeats must be positive, got {repeats}")
    if warmup_prompts < 0:
        raise ValueError(f"warmup_prompts must be >= 0, got {warmup_prompts}")
    name = mode_name(config)
    started = time.monotonic()
    engine = DataParallelEngine(config)
    runs: list[dict[str, Any]] = []
    try:
        init = time.monotonic() - started
        asyncio.run(_first_token(engine))
        startup = {name: {"engine_init_s": init,
                          "startup_to_first_token_s": time.monotonic() - started}}
        if warmup_prompts:
            asyncio.run(run_once(engine, requests[:warmup_prompts], tag=f"warmup-{name}",
                                 progress=progress))
        for rep in range(repeats):
            asyncio.run(engine.call_all(LLMEngine.reset_prefix_cache))  # every run starts cold
            result = asyncio.run(run_once(engine, requests, tag=f"{name}-{rep}",
                                          progress=progress))
            runs.append({"mode": name, "repeat": rep, **result})
    finally:
        engine.shutdown()
    return {"startup": startup, "runs": runs, **summarise_runs(runs)}
