"""s13's engine part: a compressed KV cache through the whole engine (scheduler, pages or
blocks, the quantising write, the twins, prefix caching, decode graphs on CUDA), on s4's tiny
random Llama (the GPU machine has no gguf, so no default model).

The device's compressed dtype: fp8_e4m3 on CUDA; on a CPU dry run the CPU's int8 (fp8 is a GPU
format there), so the same code runs. Rules:
  - virtual == paged tokens exactly (one write and one twin per addressing, the same rows);
  - the same prompts again, prefix caching on, give the same tokens (cached rows keep their
    scales);
  - against the bf16 cache: equal until the first divergence, where the float reference (s4's
    bf16-weight transformers model in float32) rates both picks within NEAR_TIE_COMPRESSED
    logits. e4m3 keeps 3 mantissa bits (2^-4 relative per value where bf16 is 2^-8), so the
    band is wider than s4's bf16 one (0.1): 0.3 is 6 % of this model's mean logit range (4.8;
    logit std 0.79, median top-2 margin 0.17). The CPU dry run's int8 flips at gaps of 0.004
    and 0.016. Every divergence's position, margin and gap is recorded;
  - the KV accounting balances after every engine (no page, block or scale row leaked).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common import DEVICE, ON_CPU, WORK, Result, guard
from s4_tokens import NEW_TOKENS, Comparer, tiny_model

#: logits between the two picks at a compressed-vs-bf16 divergence that still count as a tie
NEAR_TIE_COMPRESSED = 0.3
COMPRESSED = "int8" if ON_CPU else "fp8_e4m3"


def engine_tokens(path: Path, mode: str, kv_dtype: str, prompts: list[list[int]],
                  res: Result) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy tokens of ``prompts`` through one engine, then again (prefix hits); the KV
    accounting checked before the engine closes."""
    from vmkv.llm import LLM
    from vmkv.sampling_params import SamplingParams

    llm = LLM(str(path), kv_mode=mode, device=DEVICE, dtype="bfloat16",
              kv_cache_dtype=kv_dtype, kv_cache_memory=256 << 20, max_model_len=512,
              max_num_seqs=8, max_num_batched_tokens=512)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        runs = [[list(o.outputs[0].token_ids) for o in llm.generate(prompts, params,
                                                                     use_tqdm=False)]
                for _ in range(2)]
        llm.engine.kv.accounting.check()
        res.check(f"engine/{mode}/{kv_dtype}: KV accounting balances", True)
    finally:
        llm.engine.close()
    return runs[0], runs[1]


def run(res: Result) -> None:
    """The engine part: bf16 KV (virtual) as the reference, then the compressed dtype in both
    modes; every check recorded as it is made."""
    path = WORK / "tiny-llama-kv"
    hf, prompts = tiny_model(path)
    cmp = Comparer(res, hf, prompts)
    for mode, kv_dtype in (("virtual", "auto"), ("virtual", COMPRESSED), ("paged", COMPRESSED)):
        name = f"engine/{mode}/{kv_dtype}"
        both: Any = guard(res, name, lambda m=mode, k=kv_dtype: engine_tokens(path, m, k,
                                                                              prompts, res))
        if both is None:
            continue
        cmp.add(name, both[0])
        cmp.add(name + "/again", both[1])
        cmp.compare(name + "/again", name, exact=True)  # a prefix hit changes nothing
    compressed = f"engine/virtual/{COMPRESSED}"
    cmp.compare(f"engine/paged/{COMPRESSED}", compressed, exact=True)  # the twins: exact
    cmp.compare(compressed, "engine/virtual/auto", tol=NEAR_TIE_COMPRESSED)
