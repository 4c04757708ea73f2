"""Engine runs shared by the study's parts: a mix's requests, and engines run alternately on
them with this process's counters around every run (``vmkv bench throughput``'s
:func:`~vmkv.bench.throughput.run_once` does each run)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

from vmkv.bench import throughput
from vmkv.bench.common import workload_for_model
from vmkv.bench.study.counters import process_counters
from vmkv.bench.study.scale import Scale
from vmkv.bench.workloads import BenchRequest, WorkloadSpec
from vmkv.config import EngineConfig

SEED = 0
#: per-step trace points kept per run (the runs' own traces are downsampled to this)
TRACE_POINTS = 100


def mix_workload(scale: Scale, mix: str, num_prompts: int | None = None
                 ) -> tuple[list[BenchRequest], dict[str, Any]]:
    """The mix's requests at ``scale`` (random token ids, seed 0) and their description."""
    prompt, output = scale.mix(mix)
    spec = WorkloadSpec("random", num_prompts=num_prompts or scale.num_prompts,
                        input_len=prompt, output_len=output, seed=SEED)
    requests, info = workload_for_model(spec, None)
    return requests, {**info, "mix": mix}


def warmup_requests(requests: Sequence[BenchRequest], n: int) -> list[BenchRequest]:
    """The first ``n`` requests, cut to 32 prompt and 8 output tokens: a warm-up runs every
    code path (prefill, decode, growth) without costing a long decode."""
    return [BenchRequest(r.prompt_token_ids[:32], min(r.output_len, 8)) for r in requests[:n]]


def engine_config(scale: Scale, **fields: Any) -> EngineConfig:
    """An engine of the study: float32, the scale's KV budget, seed 0, then ``fields``."""
    return EngineConfig(**{"dtype": "float32", "kv_cache_memory": scale.kv_cache_memory,
                           "seed": SEED, **fields})


@contextmanager
def built(configs: dict[str, EngineConfig]) -> Iterator[dict[str, Any]]:
    """``{name: engine}`` built one after another (each with a cold first token, as ``bench
    throughput``), closed on exit; ``startup`` of each is in the yielded dict's "startup"."""
    engines: dict[str, Any] = {}
    with ExitStack() as stack:
        startup = {}
        for name, config in configs.items():
            engine, startup[name] = throughput.build_engine(config)
            stack.callback(engine.close)
            engines[name] = engine
        yield {"engines": engines, "startup": startup}


def alternate(engines: dict[str, Any], requests: Sequence[BenchRequest], *, repeats: int,
              warmup: Sequence[BenchRequest] = (), tick: Callable[[], None] = lambda: None
              ) -> list[dict[str, Any]]:
    """Warm each engine up on ``warmup``, then run ``requests`` ``repeats`` times on every
    engine, alternating them and flipping the order every repetition (A B, B A, ...) as
    ``bench throughput`` does; the prefix cache is reset before every run. Each run is
    :func:`~vmkv.bench.throughput.run_once`'s record plus ``mode``, ``repeat`` and the process
    counters (faults, context switches, TLB misses where readable) around it."""
    names = list(engines)
    for name in names:
        if warmup:
            throughput.run_once(engines[name], warmup, tag=f"warmup-{name}", progress=False)
    runs = []
    for rep in range(repeats):
        for name in names if rep % 2 == 0 else names[::-1]:
            engines[name].reset_prefix_cache()  # every repetition starts cold
            with process_counters() as counters:
                run = throughput.run_once(engines[name], requests, tag=f"{name}-{rep}",
                                          progress=False)
            stride = max(1, -(-len(run["trace"]["t"]) // TRACE_POINTS))
            run["trace"] = {k: v[::stride] for k, v in run["trace"].items()}
            runs.append({"mode": name, "repeat": rep, **run, **counters})
            tick()
    return runs
