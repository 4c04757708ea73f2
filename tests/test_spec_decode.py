"""Speculative decoding on the real default model: greedy tokens with proposals equal those
without in both KV modes (an input-grounded prompt that accepts many proposals, and plain
ones), the KV accounting holds after, and two tensor-parallel ranks agree whole (VMKV_TP_CHECK
compares their KV managers after every step) while proposals are accepted and rolled back."""

from __future__ import annotations

from pathlib import Path

import pytest

from vmkv.config import EngineConfig
from vmkv.engine.llm_engine import LLMEngine
from vmkv.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}
GREEDY = SamplingParams(temperature=0.0, max_tokens=48)


def copy_prompt() -> str:
    """An input-grounded prompt: copy a piece of this project's source."""
    text = (ROOT / "vmkv" / "engine" / "scheduler.py").read_text()[2000:3200]
    return f"Copy this text exactly:\n{text}\nCopy:\n"


PROMPTS = [copy_prompt(), "Hello, my name is", "The capital of France is"]


def run(engine: LLMEngine, prompts: list[str], params: SamplingParams = GREEDY
        ) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
    engine.kv.accounting.check()
    assert engine.kv.room.request_ids() == []
    return done


@pytest.mark.parametrize("kv_mode", ["virtual", "paged"])
def test_greedy_tokens_with_speculation_equal_those_without(kv_mode: str,
                                                            default_model: str) -> None:
    """One engine, run without proposals (its scheduler gets no proposer: the path of an
    engine without speculation) and with them."""
    engine = LLMEngine(EngineConfig(model=str(default_model), kv_mode=kv_mode,
                                    max_model_len=1024, kv_cache_memory=64 << 20,
                                    speculative_config=NGRAM))
    try:
        propose, outputs = engine.scheduler.propose, {}
        for spec in (False, True):
            engine.scheduler.propose = propose if spec else None
            outputs[spec] = run(engine, PROMPTS)
        counters = engine.spec.counters  # type: ignore[union-attr]
        assert counters.num_accepted_tokens > 10
        assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
        assert sum(counters.accepted_per_pos) == counters.num_accepted_tokens
    finally:
        engine.close()
    assert outputs[True] == outputs[False]


@pytest.mark.parametrize("kv_mode", ["virtual", "paged"])
def test_ranks_agree_with_speculation(kv_mode: str, default_model: str,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Three ranks (one KV head each) with proposals accepted and rolled back: their KV
    managers agree after every step, and their tokens equal one rank's without proposals."""
    monkeypatch.setenv("VMKV_TP_CHECK", "1")
    results = {}
    for tp, spec in ((1, None), (3, NGRAM)):
        engine = LLMEngine(EngineConfig(
            model=str(default_model), kv_mode=kv_mode, tensor_parallel_size=tp,
            enforce_eager=True, max_model_len=512, kv_cache_memory=64 << 20,
            speculative_config=spec))
        try:
            results[tp] = run(engine, PROMPTS[:2], SamplingParams(temperature=0.0,
                                                                  max_tokens=24))
            if spec is not None:
                counters = engine.spec.counters  # type: ignore[union-attr]
                assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
        finally:
            engine.close()
    assert results[3] == results[1]


def test_suffix_method_learns_from_finished_outputs(default_model: str) -> None:
    """A prompt the request cannot copy from: the second time, the index of finished outputs
    proposes what the first answer said, and the tokens are the same as without speculation."""
    prompt = ["Once upon a time, in a small village by the sea,"]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs, rates = [], []
    for spec in (None, {"method": "suffix", "num_speculative_tokens": 6}):
        engine = LLMEngine(EngineConfig(model=str(default_model), max_model_len=1024,
                                        kv_cache_memory=64 << 20, speculative_config=spec,
                                        enable_prefix_caching=False))
        try:
            for _ in range(2 if spec else 1):
                outputs.append(run(engine, prompt, params)["0"])
                if spec is not None:
                    rates.append(engine.spec.counters.num_accepted_tokens)  # type: ignore
        finally:
            engine.close()
    assert outputs[1] == outputs[0] == outputs[2]
    assert rates[1] - rates[0] > 0.6 * len(outputs[0])  # most of it, the second time


def test_draft_model_drafting_for_itself_accepts_every_proposal(default_model: str) -> None:
    """The default model drafts for itself (float32: its prefill and decode agree bit for bit):
    greedy acceptance is 100 %, the tokens are those without speculation, and the draft's own
    cache holds nothing after."""
    outputs = {}
    for spec in (None, {"method": "draft_model", "num_speculative_tokens": 3}):
        engine = LLMEngine(EngineConfig(model=str(default_model), max_model_len=512,
                                        kv_cache_memory=32 << 20, dtype="float32",
                                        speculative_config=spec))
        try:
            outputs[spec is not None] = run(engine, PROMPTS[1:], SamplingParams(
                temperature=0.0, max_tokens=20, ignore_eos=True))
            if spec is not None:
                counters = engine.spec.counters  # type: ignore[union-attr]
                assert counters.num_drafts > 0
                assert counters.num_accepted_tokens == counters.num_draft_tokens
                draft_kv = engine.spec.proposer.executor.kv  # type: ignore[union-attr]
                assert draft_kv.room.request_ids() == []
                draft_kv.accounting.check()
        finally:
            engine.close()
    assert outputs[True] == outputs[False]
