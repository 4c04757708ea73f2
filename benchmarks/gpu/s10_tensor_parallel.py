"""Step 10 (optional, with time left): tensor parallelism over NCCL, when the machine has two
GPUs or more; with one GPU it records "single GPU: TP not exercised" and passes.

A random-weight tiny Llama (8 heads, 2 KV heads: one per rank) in bfloat16, saved with a
word tokenizer; the engine with ``tensor_parallel_size=2`` (rank 0 on
cuda:0, its spawned worker on cuda:1, NCCL all-reduces, gloo step messages) must produce the
1-rank engine's greedy tokens in both KV modes (bf16 sums in another order, so a difference
is recorded with the tokens, not failed). ``VMKV_CHECK_DEVICE=cpu`` runs the
same engines on CPU over gloo (the dry run).
"""

from __future__ import annotations

from typing import Any

from common import (
    DEVICE,
    ON_CPU,
    WORK,
    Result,
    guard,
    run_step,
    save_word_tokenizer,
    tiny_llama_config,
)

NEW_TOKENS = 16
PROMPTS = [[1, 5, 9, 33, 70, 12], [1, 200, 201, 202, 203, 204, 205, 206, 207, 208]]


def engine_tokens(path: Any, kv_mode: str, tp: int) -> list[list[int]]:
    """Greedy tokens of PROMPTS from an engine of ``tp`` ranks."""
    from vmkv.config import EngineConfig
    from vmkv.engine.llm_engine import LLMEngine
    from vmkv.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(path), device=DEVICE, kv_mode=kv_mode,
                                    tensor_parallel_size=tp, enforce_eager=True,
                                    max_model_len=512, kv_cache_memory=64 << 20,
                                    dtype="float32" if ON_CPU else "bfloat16"))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), prompt, params)
        done: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            done.update((o.request_id, o.outputs[0].token_ids) for o in engine.step()
                        if o.finished)
        return [done[str(i)] for i in range(len(PROMPTS))]
    finally:
        engine.close()


def main(res: Result) -> None:
    import torch

    gpus = 0 if ON_CPU else torch.cuda.device_count()
    res.record("gpus", gpus)
    if not ON_CPU and gpus < 2:
        res.headline = f"single GPU ({gpus}): TP not exercised"
        res.check("tensor parallel", True, note=res.headline)
        return
    from transformers import AutoModelForCausalLM

    cfg = tiny_llama_config(num_attention_heads=8, num_key_value_heads=2)
    path = WORK / "tiny-tp"
    if not (path / "config.json").is_file():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
        save_word_tokenizer(path, cfg.vocab_size)
    agree = 0
    for kv_mode in ("virtual", "paged"):
        one = guard(res, f"{kv_mode} 1 rank", lambda m=kv_mode: engine_tokens(path, m, 1))
        two = guard(res, f"{kv_mode} 2 ranks", lambda m=kv_mode: engine_tokens(path, m, 2))
        if one is None or two is None:
            continue
        res.record(f"tokens_{kv_mode}", {"tp1": one, "tp2": two})
        same = one == two
        agree += same
        res.check(f"{kv_mode}: 2 ranks ran", len(two) == len(PROMPTS), equal_to_tp1=same)
    res.headline = (f"TP=2 over {'gloo (cpu dry run)' if ON_CPU else 'NCCL'}: "
                    f"{agree}/2 KV modes token-equal to TP=1")


if __name__ == "__main__":
    run_step("s10_tensor_parallel", main)
