"""How big each part of the study is: ``full`` (the committed study, <= 60 min on 2 cores),
``quick`` (<= 10 min: the same questions on fewer and shorter requests) and ``smoke`` (seconds:
the test's, every code path once, numbers meaningless)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from vmkv.bench.workloads import MIXES, Range

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

#: the virtual-tax variants: name -> EngineConfig fields (the rest: the engine's defaults, the
#: KV budget of the scale, float32); "virtual" is the CPU default (per-layer, 16K, a growth
#: maps 128 tokens (premap 5), every page created and touched at start-up, half of them mapped
#: into the idle slots); "pages on demand" does neither of the last two
TAX_VARIANTS: dict[str, dict[str, Any]] = {
    "paged": {"kv_mode": "paged"},
    "virtual": {},
    "virtual, premap 0": {"premap_pages": 0},
    "virtual, pages on demand": {"precreate_pages": False},
    "virtual, per-layer 64K": {"page_size": 64 * KiB},
    "virtual, all-layers 64K": {"kv_layout": "all-layers", "page_size": 64 * KiB},
    "virtual, all-layers 2M": {"kv_layout": "all-layers", "page_size": 2 * MiB},
}


@dataclass(frozen=True)
class Scale:
    """Every size the parts use; recorded with each part (a part measured at another scale is
    measured again)."""

    name: str
    # end to end: requests per mix, mix lengths x length_scale, alternated repetitions
    num_prompts: int
    length_scale: float
    repeats: int
    warmup_prompts: int
    kv_cache_memory: int
    tax_kv_cache_memory: int  # 7 engines at once in the tax part: paged and pre-created commit it
    bf16: bool  # also bfloat16 where the CPU has bf16 hardware
    prefix_prompts: int
    prefix_len: int
    serve_prompts: int
    # memory: requests drawn per mix for the useful-fraction figures
    memory_prompts: int
    # translation: attention alone
    kernel_batches: tuple[int, ...]
    kernel_contexts: tuple[int, ...]
    kernel_phases: tuple[str, ...]
    kernel_prefill_len: int
    kernel_repeats: int
    kernel_warmup: int
    kernel_pages: tuple[tuple[str, int], ...]  # (layout, page) decode-only variants
    kernel_blocks: tuple[int, ...]  # paged block sizes, decode only, beside 16
    # virtual tax
    tax_variants: tuple[str, ...]
    tax_mix: str
    profile_batch: int
    profile_context: int
    profile_prefill: tuple[int, int]  # requests, tokens each
    profile_repeats: int
    # map latency hidden
    vmm_page_sizes: tuple[int, ...]
    vmm_max_pages: int
    replay_batch: int
    replay_steps: int
    replay_compute_ms: float
    # elastic memory
    elastic_bursts: tuple[int, ...]
    elastic_idle_s: float
    elastic_max_tokens: int
    elastic_words: tuple[int, int]
    #: expected minutes per part on a 2-core machine (the ETA printed before a part starts)
    expected_min: tuple[tuple[str, float], ...] = ()

    def mix(self, name: str) -> tuple[Range, Range]:
        """The mix's (prompt, output) length ranges at this scale."""
        return tuple(self._scaled(r) for r in MIXES[name])  # type: ignore[return-value]

    def _scaled(self, r: Range) -> Range:
        lo = max(1, round(r[0] * self.length_scale))
        return lo, max(lo, round(r[1] * self.length_scale))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


FULL = Scale(
    name="full", num_prompts=32, length_scale=1.0, repeats=3, warmup_prompts=4,
    kv_cache_memory=2 * GiB, tax_kv_cache_memory=1 * GiB, bf16=True,
    prefix_prompts=32, prefix_len=512, serve_prompts=32,
    memory_prompts=64,
    kernel_batches=(1, 8, 32), kernel_contexts=(256, 1024, 4096),
    kernel_phases=("decode", "decode-sdpa", "prefill"), kernel_prefill_len=256,
    kernel_repeats=10, kernel_warmup=2,
    kernel_pages=(("per-layer", 64 * KiB), ("all-layers", 2 * MiB)), kernel_blocks=(64,),
    tax_variants=tuple(TAX_VARIANTS), tax_mix="balanced",
    profile_batch=64, profile_context=300, profile_prefill=(8, 256), profile_repeats=5,
    vmm_page_sizes=(4 * KiB, 16 * KiB, 64 * KiB, 2 * MiB), vmm_max_pages=2048,
    replay_batch=64, replay_steps=256, replay_compute_ms=50.0,
    elastic_bursts=(48, 16, 32), elastic_idle_s=20.0, elastic_max_tokens=64,
    elastic_words=(200, 600),
    expected_min=(("memory", 0.5), ("translation", 5), ("tax", 8), ("mapping", 1.5),
                  ("end_to_end", 18), ("elastic", 4), ("kv_dtype", 9), ("gpu", 0)),
)

QUICK = Scale(
    name="quick", num_prompts=16, length_scale=0.25, repeats=2, warmup_prompts=2,
    kv_cache_memory=1 * GiB, tax_kv_cache_memory=512 * MiB, bf16=True,
    prefix_prompts=16, prefix_len=256, serve_prompts=16,
    memory_prompts=64,
    kernel_batches=(1, 16), kernel_contexts=(256, 1024), kernel_phases=("decode", "prefill"),
    kernel_prefill_len=128, kernel_repeats=5, kernel_warmup=1,
    kernel_pages=(("per-layer", 64 * KiB),), kernel_blocks=(64,),
    tax_variants=("paged", "virtual", "virtual, premap 0", "virtual, pages on demand",
                  "virtual, per-layer 64K", "virtual, all-layers 64K"),
    tax_mix="balanced",
    profile_batch=16, profile_context=256, profile_prefill=(2, 256), profile_repeats=3,
    vmm_page_sizes=(4 * KiB, 16 * KiB, 64 * KiB, 2 * MiB), vmm_max_pages=256,
    replay_batch=16, replay_steps=64, replay_compute_ms=20.0,
    elastic_bursts=(16, 8), elastic_idle_s=4.0, elastic_max_tokens=16, elastic_words=(50, 150),
    expected_min=(("memory", 0.3), ("translation", 0.3), ("tax", 1), ("mapping", 0.1),
                  ("end_to_end", 3.5), ("elastic", 0.7), ("kv_dtype", 2), ("gpu", 0)),
)

SMOKE = Scale(
    name="smoke", num_prompts=2, length_scale=0.03, repeats=1, warmup_prompts=1,
    kv_cache_memory=64 * MiB, tax_kv_cache_memory=64 * MiB, bf16=False,
    prefix_prompts=2, prefix_len=32, serve_prompts=2,
    memory_prompts=4,
    kernel_batches=(1,), kernel_contexts=(32,), kernel_phases=("decode", "prefill"),
    kernel_prefill_len=8, kernel_repeats=1, kernel_warmup=0,
    kernel_pages=(("per-layer", 64 * KiB),), kernel_blocks=(32,),
    tax_variants=("paged", "virtual", "virtual, premap 0"), tax_mix="balanced",
    profile_batch=2, profile_context=16, profile_prefill=(1, 8), profile_repeats=1,
    vmm_page_sizes=(16 * KiB, 64 * KiB), vmm_max_pages=8,
    replay_batch=2, replay_steps=4, replay_compute_ms=1.0,
    elastic_bursts=(2,), elastic_idle_s=1.0, elastic_max_tokens=2, elastic_words=(5, 10),
)

SCALES = {s.name: s for s in (FULL, QUICK, SMOKE)}
