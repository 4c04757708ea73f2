"""``vmkv bench throughput``: offline, in-process, every request queued at once (vLLM's
``bench throughput``), stepping :class:`~vmkv.engine.llm_engine.LLMEngine` directly so KV memory
can be sampled after every step.

Every request is greedy (or sampled, in the sampling twin) with ``ignore_eos=True`` and
``max_tokens=output_len``, so each mode and engine does exactly the same work. Per run:

    throughput      requests/s, output tokens/s, total (prompt + output) tokens/s
    KV memory       peak and mean ``usage.bytes_in_use`` (what live requests need), peak
                    ``bytes_held`` (plus pages kept mapped for reuse), useful fraction
                    (token bytes / bytes in use, summed over every step's sample)
    scheduler       preemptions and recomputed tokens (``engine.scheduler.stats``, this run)
    page mapping    virtual mode: time inside map + unmap + create + release calls (this run)

The time spent sampling ``usage`` is measured and left out of the throughput (it is reported as
``sample_overhead_s``). With two modes, both engines are built once and run alternately, the
order flipped every repetition (V P, P V, V P...) so slow drift of a shared machine falls on
both; each engine runs a warm-up (the first ``warmup_prompts`` requests) before the first
repetition. With prefix caching on, the cache is reset before every repetition, so hits come only
from sharing within the repetition (not from the warm-up or an earlier repetition).
``--compare-prefix-caching`` adds a caching-on twin of every engine (``virtual+prefix``...), run
in the same alternation, and reports on/off per mode and repetition: the overhead of caching at
a 0 % hit rate, or its gain on shared prefixes, measured side by side.
``--compare-structured-outputs`` runs every engine's workload twice per repetition, plain and
constrained by :data:`BENCH_SCHEMA` (``virtual+json``...), alternated, and reports
constrained/plain: the cost of structured outputs at the same lengths. ``--compare-sampling T``
likewise runs every workload greedy and sampled at temperature T (``virtual+sampled``...) and
reports sampled/greedy: the cost of random sampling at the same lengths.
"""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vmkv.bench.common import progress_bar
from vmkv.bench.workloads import BenchRequest
from vmkv.config import EngineConfig
from vmkv.engine.llm_engine import LLMEngine
from vmkv.sampling_params import RequestOutputKind, SamplingParams
from vmkv.structured import StructuredOutputsParams

MAX_TRACE_POINTS = 400
MAP_OPS = ("map", "unmap", "create", "release")

#: the structured-output workload's schema: a list of records (integers and numbers with bounds,
#: a bounded string, an enum array) that can never be complete (minItems), so every constrained
#: request writes exactly ``output_len`` tokens, as the plain ones do; compact separators, so
#: every token is structure or content (greedy small models otherwise pad with newlines)
BENCH_SCHEMA = {"type": "array", "minItems": 100_000, "items": {
    "type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 1_000_000},
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "score": {"type": "number", "minimum": 0, "maximum": 1}},
    "required": ["id", "name", "tags", "score"]}}
BENCH_STRUCTURE = StructuredOutputsParams(json=BENCH_SCHEMA, disable_any_whitespace=True)


PREFIX_SUFFIX = "+prefix"  # name suffix of the prefix-caching twin (--compare-prefix-caching)
STRUCTURED_SUFFIX = "+json"  # name of the constrained runs (--compare-structured-outputs)
SAMPLED_SUFFIX = "+sampled"  # name of the sampled runs (--compare-sampling)
TWINS = {"prefix": PREFIX_SUFFIX, "structured": STRUCTURED_SUFFIX,
         "sampled": SAMPLED_SUFFIX}


@dataclass(frozen=True)
class RequestKind:
    """How every request of a run asks: greedy or sampled at ``temperature`` (unseeded: the
    engine's generator), optionally constrained by ``structured``; ``suffix`` names the runs
    (``""``: the plain greedy runs)."""

    suffix: str = ""
    structured: StructuredOutputsParams | None = None
    temperature: float = 0.0


PLAIN = RequestKind()
STRUCTURED = RequestKind(STRUCTURED_SUFFIX, structured=BENCH_STRUCTURE)


def sampled(temperature: float) -> RequestKind:
    """The sampling twin at ``temperature`` (> 0)."""
    if not temperature > 0:
        raise ValueError(f"--compare-sampling takes a temperature > 0, got {temperature}")
    return RequestKind(SAMPLED_SUFFIX, temperature=temperature)


def params_for(output_len: int, kind: RequestKind = PLAIN) -> SamplingParams:
    """EOS ignored, exactly ``output_len`` tokens (the same work on every engine), as ``kind``
    asks; one output per request, at its end."""
    return SamplingParams(temperature=kind.temperature, max_tokens=output_len, ignore_eos=True,
                          structured_outputs=kind.structured,
                          output_kind=RequestOutputKind.FINAL_ONLY)


def build_engine(config: EngineConfig) -> tuple[LLMEngine, dict[str, float]]:
    """Construct the engine and run one 1-token request right away (a cold first token).

    Returns the engine and ``{"engine_init_s", "startup_to_first_token_s"}``, both measured from
    the start of construction (the model cached; process start-up is ``bench startup``'s).
    """
    started = time.monotonic()
    engine = LLMEngine(config)
    init = time.monotonic() - started
    engine.add_request("bench-probe", [engine.tokenizer.bos_token_id or 1] * 8, params_for(1))
    while engine.has_unfinished_requests():
        engine.step()
    return engine, {"engine_init_s": init,
                    "startup_to_first_token_s": time.monotonic() - started}


def _op_totals(engine: LLMEngine) -> dict[str, dict[str, int]]:
    """The KV manager's mapping counters (empty in paged mode, which maps nothing)."""
    return {op: {"calls": int(s["calls"]), "pages": int(s["pages"]),
                 "total_ns": round(s["total_ms"] * 1e6)}
            for op, s in engine.kv.accounting.memory_stats().items() if op in MAP_OPS}


@dataclass
class _Trace:
    t: list[float] = field(default_factory=list)
    bytes_in_use: list[int] = field(default_factory=list)
    bytes_held: list[int] = field(default_factory=list)
    token_bytes: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)

    def sample(self, engine: LLMEngine, t: float) -> None:
        usage = engine.kv.accounting.usage
        self.t.append(t)
        self.bytes_in_use.append(usage.bytes_in_use)
        self.bytes_held.append(usage.bytes_held)
        self.token_bytes.append(usage.token_bytes)
        self.running.append(usage.num_requests)

    def downsampled(self) -> dict[str, list[float]]:
        stride = max(1, -(-len(self.t) // MAX_TRACE_POINTS))
        return {k: v[::stride] for k, v in self.__dict__.items()}


def run_once(engine: LLMEngine, requests: Sequence[BenchRequest], *, tag: str,
             progress: bool = True, kind: RequestKind = PLAIN) -> dict[str, Any]:
    """Queue every request (asked as ``kind`` says), step until all finish, and return the
    run's numbers."""
    stats = engine.scheduler.stats
    before = (stats.num_preemptions, stats.num_recomputed_tokens)
    ops_before = _op_totals(engine)
    spec_before = engine.spec.counters.copy() if engine.spec is not None else None
    ids = [f"{tag}-{i}" for i in range(len(requests))]
    bar = progress_bar(progress, tag, total=len(requests))
    faults_start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start, cpu_start = time.monotonic(), time.process_time()
    for rid, r in zip(ids, requests, strict=True):
        engine.add_request(rid, r.prompt_token_ids, params_for(r.output_len, kind))
    trace, overhead = _Trace(), 0.0
    outputs: dict[str, Any] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
                bar.update(1)
        steps += 1
        t = time.monotonic()
        trace.sample(engine, t - start - overhead)
        overhead += time.monotonic() - t
    wall, cpu = time.monotonic() - start, time.process_time() - cpu_start
    minor_faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_start
    bar.close()
    elapsed = wall - overhead
    result = summarise_outputs(requests, [outputs[rid] for rid in ids], elapsed, start)
    result.update(_kv_numbers(trace))
    result["preemptions"] = stats.num_preemptions - before[0]
    result["recomputed_tokens"] = stats.num_recomputed_tokens - before[1]
    result.update(_map_numbers(ops_before, _op_totals(engine)))
    if engine.spec is not None and spec_before is not None:  # vLLM's spec_decode counters
        result["spec_decode"] = engine.spec.counters.since(spec_before).as_dict()
    result.update(steps=steps, wall_s=wall, sample_overhead_s=overhead, cpu_s=cpu,
                  minor_faults=minor_faults,
                  output_tokens_per_cpu_s=result["output_tokens"] / cpu if cpu else None,
                  trace=trace.downsampled())
    return result


def summarise_outputs(requests: Sequence[BenchRequest], outs: list[Any], elapsed: float,
                      start: float) -> dict[str, Any]:
    """Throughput and latency of one run: ``outs[i]`` is the final output of ``requests[i]``,
    ``start`` the run's ``time.monotonic()`` (system-wide: replica processes' times too)."""
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft = [o.metrics.first_token_time - start for o in outs if o.metrics.first_token_time]
    e2e = [o.metrics.finish_time - start for o in outs if o.metrics.finish_time]
    return {
        "elapsed_s": elapsed,
        "num_requests": len(requests),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "requested_output_tokens": sum(r.output_len for r in requests),
        "cached_prompt_tokens": sum(o.num_cached_tokens for o in outs),  # prefix cache hits
        "short_outputs": sum(len(o.outputs[0].token_ids) < r.output_len
                             for o, r in zip(outs, requests, strict=True)),
        "requests_per_s": len(requests) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
        "first_token_s": min(ttft) if ttft else None,
        "mean_ttft_s": statistics.fmean(ttft) if ttft else None,
        "mean_e2e_s": statistics.fmean(e2e) if e2e else None,
    }


def _kv_numbers(trace: _Trace) -> dict[str, Any]:
    in_use = sum(trace.bytes_in_use)
    fractions = [t / b for t, b in zip(trace.token_bytes, trace.bytes_in_use, strict=True) if b]
    return {
        "peak_kv_bytes_in_use": max(trace.bytes_in_use, default=0),
        "peak_kv_bytes_held": max(trace.bytes_held, default=0),
        "mean_kv_bytes_in_use": in_use / len(trace.t) if trace.t else 0.0,
        # byte-weighted over every step: sum(token bytes) / sum(bytes in use)
        "kv_useful_fraction": sum(trace.token_bytes) / in_use if in_use else None,
        "kv_useful_fraction_min": min(fractions, default=None),
    }


def _map_numbers(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]
                 ) -> dict[str, Any]:
    if not after:
        return {"map_stall_s": 0.0, "map_ops": {}}
    ops = {op: {k: after[op][k] - before[op][k] for k in after[op]} for op in after}
    return {"map_stall_s": sum(o["total_ns"] for o in ops.values()) / 1e9, "map_ops": ops}


def run(configs: dict[str, EngineConfig], requests: Sequence[BenchRequest], *, repeats: int = 3,
        warmup_prompts: int = 8, progress: bool = True,
        twin: RequestKind | None = None) -> dict[str, Any]:
    """Build one engine per mode (``{"virtual": cfg, "paged": cfg}`` or one of them), warm each
    up, then run the workload ``repeats`` times per mode, alternating modes. With
    ``twin`` (:data:`STRUCTURED`, :func:`sampled`), every engine also runs it so asked (as
    ``<mode>+json``, ``<mode>+sampled``), alternated.

    Returns ``{"startup", "dtype", "runs", "summary", "ratios"?, "ratio_median"?}`` (``dtype``:
    each mode's dtype and why: asked for, or what ``auto`` picked on this CPU); each run carries
    ``mode`` and ``repeat``; ``ratios`` (virtual/paged output tokens/s per repetition) only
    when both modes ran.
    """
    if repeats <= 0:
        raise ValueError(f"repeats must be positive, got {repeats}")
    if warmup_prompts < 0:
        raise ValueError(f"warmup_prompts must be >= 0, got {warmup_prompts}")
    if len(configs) > 1 and any(c.tensor_parallel_size > 1 for c in configs.values()):
        raise ValueError("tensor parallelism runs one engine per process: bench one KV mode "
                         "(--kv-mode virtual or paged) without twins per run")
    engines: dict[str, LLMEngine] = {}
    startup: dict[str, dict[str, float]] = {}
    weights: dict[str, str] = {}  # each engine's weight format and resident bytes
    kv_info: dict[str, dict[str, Any]] = {}  # each engine's KV dtype and tokens per GiB
    runs: list[dict[str, Any]] = []
    try:
        for mode, config in configs.items():
            engines[mode], startup[mode] = build_engine(config)
            weights[mode] = next((line for line in engines[mode].executor.describe()
                                  if line.startswith("weights: ")), "")
            spec = engines[mode].kv.spec  # the KV dtype's bytes per token, scales included
            kv_info[mode] = {"kv_cache_dtype": config.kv_cache_dtype_name,
                             "kv_bytes_per_token": spec.bytes_per_token,
                             "kv_tokens_per_gib": 2**30 // spec.bytes_per_token}
        kinds = [PLAIN] if twin is None else [PLAIN, twin]
        variants = [(mode, kind) for mode in engines for kind in kinds]
        for mode, kind in variants:
            if warmup_prompts:
                run_once(engines[mode], requests[:warmup_prompts], tag=f"warmup-{mode}",
                         progress=progress, kind=kind)
        for rep in range(repeats):
            for mode, kind in variants if rep % 2 == 0 else variants[::-1]:
                name = mode + kind.suffix
                engines[mode].reset_prefix_cache()  # every repetition starts cold
                result = run_once(engines[mode], requests, tag=f"{name}-{rep}",
                                  progress=progress, kind=kind)
                runs.append({"mode": name, "repeat": rep, **result})
    finally:
        for engine in engines.values():
            engine.close()
    dtypes = {mode: {**dict(zip(("dtype", "why"), c.dtype_choice, strict=True)),
                     "quantization": c.quantization, "weights": weights.get(mode, ""),
                     **kv_info.get(mode, {})}
              for mode, c in configs.items()}
    return {"startup": startup, "dtype": dtypes, "runs": runs, **summarise_runs(runs)}


SUMMARY_KEYS = ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s",
                "peak_kv_bytes_in_use", "kv_useful_fraction", "preemptions", "map_stall_s")


def summarise_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-mode medians; with both modes, the virtual/paged ratio per repetition; with prefix
    caching twins (``<mode>+prefix``), the caching on/off ratio per mode and repetition; with
    constrained runs (``<mode>+json``) or sampled ones (``<mode>+sampled``), their ratio to the
    plain runs likewise."""
    summary: dict[str, dict[str, float]] = {}
    for mode in dict.fromkeys(r["mode"] for r in runs):
        mine = [r for r in runs if r["mode"] == mode]
        summary[mode] = {k: statistics.median(r[k] for r in mine) for k in SUMMARY_KEYS
                         if all(r.get(k) is not None for r in mine)}
    out: dict[str, Any] = {"summary": summary}
    by = {(r["mode"], r["repeat"]): r["output_tokens_per_s"] for r in runs}
    reps = sorted({r["repeat"] for r in runs})
    if {"virtual", "paged"} <= summary.keys():
        out["ratios"] = [by["virtual", i] / by["paged", i] for i in reps]
        out["ratio_median"] = statistics.median(out["ratios"])
    cpu = {(r["mode"], r["repeat"]): r.get("output_tokens_per_cpu_s") for r in runs}
    for key, suffix in TWINS.items():  # twin / plain, per mode and repetition
        twin = {m: [by[m + suffix, i] / by[m, i] for i in reps]
                for m in summary if m + suffix in summary}
        if twin:
            out[f"{key}_ratios"] = twin
            out[f"{key}_ratio_median"] = {m: statistics.median(v) for m, v in twin.items()}
        if twin and all(cpu[m, i] and cpu[m + suffix, i] for m in twin for i in reps):
            # the same ratio per CPU second of this process: what others' load on a shared
            # machine disturbs far less than wall time
            out[f"{key}_cpu_ratios"] = {m: [cpu[m + suffix, i] / cpu[m, i] for i in reps]
                                        for m in twin}
            out[f"{key}_cpu_ratio_median"] = {
                m: statistics.median(v) for m, v in out[f"{key}_cpu_ratios"].items()}
    return out


def table_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per run, then the per-repetition ratios and HF baseline when present."""
    def scaled(value: float | None, scale: float) -> float | str:
        return "-" if value is None else value * scale  # None: not sampled (replicas)

    rows = [{
        "mode": r["mode"], "rep": r["repeat"], "req/s": r["requests_per_s"],
        "out tok/s": r["output_tokens_per_s"], "total tok/s": r["total_tokens_per_s"],
        "peak KV MiB": scaled(r["peak_kv_bytes_in_use"], 2**-20),
        "useful %": scaled(r["kv_useful_fraction"], 100), "preempt": r["preemptions"],
        "map ms": scaled(r["map_stall_s"], 1e3), "minor faults": scaled(r["minor_faults"], 1),
        "time s": r["elapsed_s"],
    } for r in result["runs"]]
    for i, ratio in enumerate(result.get("ratios", [])):
        rows.append({"mode": "virtual/paged", "rep": i, "out tok/s": ratio})
    if "ratio_median" in result:
        rows.append({"mode": "virtual/paged", "rep": "median", "out tok/s": result["ratio_median"]})
    for key, suffix in TWINS.items():
        for kind, label in (("", ""), ("_cpu", " per cpu s")):
            for mode, ratios in result.get(f"{key}{kind}_ratios", {}).items():
                name = f"{mode}{suffix}/{mode}{label}"
                rows += [{"mode": name, "rep": i, "out tok/s": r} for i, r in enumerate(ratios)]
                rows.append({"mode": name, "rep": "median",
                             "out tok/s": result[f"{key}{kind}_ratio_median"][mode]})
    hf = result.get("hf")
    if hf:
        rows.append({"mode": f"hf (batch {hf['batch_size']})", "rep": 0,
                     "req/s": hf["requests_per_s"], "out tok/s": hf["output_tokens_per_s"],
                     "total tok/s": hf["total_tokens_per_s"], "time s": hf["elapsed_s"]})
        for mode, ratio in result.get("ratio_vs_hf", {}).items():
            rows.append({"mode": f"{mode}/hf", "rep": "median", "out tok/s": ratio})
    return rows


COLUMNS = ("mode", "rep", "req/s", "out tok/s", "total tok/s", "peak KV MiB", "useful %",
           "preempt", "map ms", "minor faults", "time s")
