"""Everything keeps working with speculative decoding on (one fast test per point, on the real
default model): each request's output with proposals equals its output without them, where
stop strings and stop tokens fall inside accepted runs, max_tokens cuts a run, logprobs are
asked for, n > 1 samples with a seed, streaming deltas carry several tokens, a grammar
constrains the output, and requests are preempted (swap and recompute)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from vmkv.chat_template import chat_token_ids
from vmkv.config import EngineConfig
from vmkv.engine.llm_engine import LLMEngine
from vmkv.engine.outputs import RequestOutput
from vmkv.sampling_params import RequestOutputKind, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}
TEXT = (ROOT / "vmkv" / "engine" / "scheduler.py").read_text()[2000:2900]
PROMPT = f"Copy this text exactly:\n{TEXT}\nCopy:\n"


class Toggle:
    """One engine with speculative decoding, run with proposals (``[True]``) or without them
    (``[False]``: the scheduler gets no proposer), so both share the weights and caches."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine, self.propose = engine, engine.scheduler.propose

    def __getitem__(self, spec: bool) -> LLMEngine:
        self.engine.scheduler.propose = self.propose if spec else None
        return self.engine


@pytest.fixture(scope="module")
def engines(default_model: str) -> Iterator[Toggle]:
    engine = LLMEngine(EngineConfig(model=str(default_model), max_model_len=1024,
                                    kv_cache_memory=64 << 20, speculative_config=NGRAM))
    yield Toggle(engine)
    engine.close()


def generate(engine: LLMEngine, params: SamplingParams, prompt: str = PROMPT
             ) -> list[RequestOutput]:
    """Every output of one request (asked as a chat turn), in order; the KV accounting holds
    after it."""
    rid = f"r{id(params)}-{engine.counters.steps}"
    engine.add_request(rid, chat_token_ids(engine.tokenizer, [{"role": "user",
                                                               "content": prompt}]), params)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    engine.kv.accounting.check()
    assert engine.kv.room.request_ids() == []
    return outs


def final(engine: LLMEngine, params: SamplingParams, prompt: str = PROMPT) -> RequestOutput:
    return generate(engine, params, prompt)[-1]


def both(engines: Toggle, params: SamplingParams) -> list[RequestOutput]:
    """The request's final output without and with proposals; proposals were accepted."""
    accepted = engines[True].spec.counters.num_accepted_tokens  # type: ignore[union-attr]
    outs = [final(engines[spec], params) for spec in (False, True)]
    assert engines[True].spec.counters.num_accepted_tokens > accepted  # type: ignore[union-attr]
    return outs


def completions(out: RequestOutput) -> list[tuple[object, ...]]:
    return [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in out.outputs]


def test_stop_strings_and_stop_tokens_inside_an_accepted_run(engines: Toggle
                                                             ) -> None:
    plain = final(engines[False], SamplingParams(temperature=0.0, max_tokens=40))
    text, tokens = plain.outputs[0].text, plain.outputs[0].token_ids
    stop = text[len(text) // 2 : len(text) // 2 + 6]
    for params in (SamplingParams(temperature=0.0, max_tokens=40, stop=[stop]),
                   SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[tokens[20]]),
                   SamplingParams(temperature=0.0, max_tokens=40, stop=[stop],
                                  include_stop_str_in_output=True)):
        without, with_spec = both(engines, params)
        assert completions(with_spec) == completions(without)
        assert with_spec.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 13])
def test_max_tokens_is_exact(engines: Toggle, max_tokens: int) -> None:
    out = final(engines[True], SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                              ignore_eos=True))
    assert len(out.outputs[0].token_ids) == max_tokens
    assert out.outputs[0].finish_reason == "length"


def test_logprobs_of_the_emitted_tokens(engines: Toggle) -> None:
    without, with_spec = both(engines, SamplingParams(temperature=0.0, max_tokens=30,
                                                      logprobs=2))
    assert with_spec.outputs[0].token_ids == without.outputs[0].token_ids
    for a, b in zip(with_spec.outputs[0].logprobs, without.outputs[0].logprobs, strict=True):
        assert a.keys() == b.keys()
        assert [a[t] for t in a] == pytest.approx([b[t] for t in a], abs=1e-4)


def test_n_samples_with_a_seed(engines: Toggle) -> None:
    """Each emitted token draws one noise row from the sample's generator, proposals or not,
    so seeded samples are the same."""
    params = SamplingParams(temperature=0.7, max_tokens=30, n=2, seed=11)
    without, with_spec = both(engines, params)
    assert completions(with_spec) == completions(without)
    assert len(with_spec.outputs) == 2


def test_streaming_deltas_add_up(engines: Toggle) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40,
                            output_kind=RequestOutputKind.DELTA)
    whole = final(engines[False], SamplingParams(temperature=0.0, max_tokens=40))
    deltas = generate(engines[True], params)
    assert "".join(d.outputs[0].text for d in deltas if d.outputs) == whole.outputs[0].text
    tokens = [t for d in deltas if d.outputs for t in d.outputs[0].token_ids]
    assert tokens == whole.outputs[0].token_ids
    assert max(len(d.outputs[0].token_ids) for d in deltas if d.outputs) > 1  # runs


def test_a_grammar_checks_the_proposals(engines: Toggle) -> None:
    """The grammar masks every verified row; a proposal it forbids is never taken."""
    params = SamplingParams(temperature=0.0, max_tokens=40,
                            structured_outputs={"regex": r"(state \w+ ){1,6}\."})
    prompt = "Repeat after me: state one state two state three state four state five."
    outs = [final(engines[spec], params, prompt) for spec in (False, True)]
    assert completions(outs[1]) == completions(outs[0])
    assert outs[1].outputs[0].text.startswith("state ")


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption(default_model: str, mode: str) -> None:
    """A cache too small for all three requests (about 520 tokens) preempts while proposals
    run."""
    outs = {}
    for spec in (None, NGRAM):
        engine = LLMEngine(EngineConfig(model=str(default_model), max_model_len=512,
                                        kv_cache_memory=24 << 20, max_num_batched_tokens=512,
                                        preemption_mode=mode, kv_mode="paged", block_size=16,
                                        speculative_config=spec))
        try:
            for i in range(3):  # ~110 prompt tokens each, growing to ~260: 520 fit
                text = f"Copy this text exactly:\n{TEXT[i * 40 : i * 40 + 300]}"
                engine.add_request(str(i), chat_token_ids(engine.tokenizer, [
                    {"role": "user", "content": text}]), SamplingParams(
                    temperature=0.0, max_tokens=150, ignore_eos=True))
            done = {}
            while engine.has_unfinished_requests():
                done.update((o.request_id, o.outputs[0].token_ids) for o in engine.step()
                            if o.finished)
            assert engine.scheduler.stats.num_preemptions > 0
            engine.kv.accounting.check()
            outs[spec is not None] = done
        finally:
            engine.close()
    assert outs[True] == outs[False]
