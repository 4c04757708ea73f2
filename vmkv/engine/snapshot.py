"""The engine's numbers at one moment (the server's ``/metrics`` renders them).

:func:`take_snapshot` runs where the engine runs, between two steps (through
``ServingEngine.call_all``, so in a replica process too: it is a module-level function, and a
:class:`Snapshot` is plain data that pickles). :func:`combine` adds up the snapshots of several
replicas into the whole server's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vmkv.engine.llm_engine import LLMEngine


@dataclass
class Snapshot:
    """Engine numbers taken on the engine thread."""

    running: int = 0
    waiting: int = 0
    usage: dict[str, float] = field(default_factory=dict)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    preemptions: int = 0
    recomputed_tokens: int = 0
    swapped_tokens: int = 0
    memory_ops: dict[str, dict[str, float]] = field(default_factory=dict)
    prefix_queries: int = 0
    prefix_hits: int = 0
    prefix_enabled: bool = False
    step_tokens: list[int] = field(default_factory=list)  # per bucket (EngineCounters)
    step_tokens_sum: int = 0
    #: speculative decoding's counters (SpecDecodeCounters.as_dict); None when it is off
    spec_decode: dict[str, Any] | None = None
    taken_at: float = field(default_factory=time.monotonic)


def take_snapshot(engine: LLMEngine) -> Snapshot:
    """Read the engine's counters (call on the engine thread)."""
    kv = engine.kv
    stats = engine.scheduler.stats
    prefix = kv.prefix.stats()
    return Snapshot(
        running=len(engine.scheduler.running),
        waiting=len(engine.scheduler.waiting),
        usage=kv.accounting.usage.as_dict(),
        prompt_tokens=engine.counters.prompt_tokens,
        generation_tokens=engine.counters.generation_tokens,
        finished=dict(engine.counters.finished),
        preemptions=stats.num_preemptions,
        recomputed_tokens=stats.num_recomputed_tokens,
        swapped_tokens=stats.num_swapped_out_tokens,
        memory_ops=kv.accounting.memory_stats(),
        prefix_queries=prefix.queries,
        prefix_hits=prefix.hits,
        prefix_enabled=prefix.enabled,
        step_tokens=list(engine.counters.step_tokens),
        step_tokens_sum=engine.counters.step_tokens_sum,
        spec_decode=engine.spec.counters.as_dict() if engine.spec is not None else None,
    )


#: recent latency percentiles: the worst replica's, not a sum
_PERCENTILES = ("p50_us", "p99_us")


def combine(snapshots: list[Snapshot]) -> Snapshot:
    """The whole server's numbers from its replicas': counts and bytes summed, the usage
    shares recomputed from the sums, latency percentiles the worst replica's, and the time
    of the oldest reading."""
    usage: dict[str, float] = {}
    for s in snapshots:
        for k, v in s.usage.items():
            usage[k] = usage.get(k, 0) + v
    capacity, in_use = usage.get("capacity_bytes", 0), usage.get("bytes_in_use", 0)
    if usage:
        usage["fraction"] = in_use / capacity if capacity else 0.0
        usage["useful_fraction"] = usage.get("token_bytes", 0) / in_use if in_use else 1.0
    finished: dict[str, int] = {}
    ops: dict[str, dict[str, float]] = {}
    for s in snapshots:
        for reason, n in s.finished.items():
            finished[reason] = finished.get(reason, 0) + n
        for op, stats in s.memory_ops.items():
            into = ops.setdefault(op, {})
            for k, v in stats.items():
                into[k] = max(into.get(k, 0), v) if k in _PERCENTILES else into.get(k, 0) + v
    steps = [sum(c) for c in zip(*(s.step_tokens for s in snapshots), strict=True)]
    total = Snapshot(usage=usage, finished=finished, memory_ops=ops, step_tokens=steps,
                     prefix_enabled=any(s.prefix_enabled for s in snapshots),
                     taken_at=min((s.taken_at for s in snapshots), default=time.monotonic()))
    for name in ("running", "waiting", "prompt_tokens", "generation_tokens", "preemptions",
                 "recomputed_tokens", "swapped_tokens", "prefix_queries", "prefix_hits",
                 "step_tokens_sum"):
        setattr(total, name, sum(getattr(s, name) for s in snapshots))
    specs = [s.spec_decode for s in snapshots if s.spec_decode is not None]
    if specs:
        total.spec_decode = {k: ([sum(c) for c in zip(*(d[k] for d in specs), strict=True)]
                                 if isinstance(specs[0][k], list) else sum(d[k] for d in specs))
                             for k in specs[0] if k.startswith("spec_decode_")}
    return total
