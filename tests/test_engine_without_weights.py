"""The whole engine (scheduler, KV manager, sampler, output processor) over a stand-in executor:
no weights, real KV memory. Scheduling, preemption in both recovery modes, forks, stop rules and
the output kinds are checked in milliseconds per step.

The stand-in model writes each computed token's id and position into layer 0's K cache, reads a
sequence's whole context back from there (as attention would), and predicts the next token from
it. So a preemption that lost or corrupted KV, or a fork that shared the wrong rows, changes
the tokens, and a run under tight memory must give the tokens of a run with ample memory.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from vmkv.commands import Abort, Add, Call, Command, Stop
from vmkv.config import CacheConfig, EngineConfig
from vmkv.engine.engine_loop import EngineLoop
from vmkv.engine.errors import EngineOverloadedError
from vmkv.engine.llm_engine import LLMEngine
from vmkv.engine.outputs import OutputAccumulator, RequestOutput
from vmkv.executor.base import Executor, StepOutput
from vmkv.executor.plan import StepPlan
from vmkv.kv import KVSpec, create_kv_cache
from vmkv.models import load_model_config, load_tokenizer
from vmkv.sampling_params import RequestOutputKind, SamplingParams

SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=2)  # [token, position] per row
FIRST, SPAN = 1000, 97  # predicted tokens come from [FIRST, FIRST + SPAN): plain text pieces


def next_token(context: list[int]) -> int:
    """The stand-in model: a deterministic function of the whole context."""
    return FIRST + (sum(context) * 31 + len(context)) % SPAN


class MarkerExecutor(Executor):
    """An executor without a model: K rows hold ``[token, position]`` markers (see the
    module docstring). ``execute`` checks every cached row it reads."""

    def __init__(self, config: EngineConfig, model_config: Any) -> None:
        self.kv = create_kv_cache(CacheConfig(
            kv_mode=config.kv_mode, kv_cache_memory=config.kv_cache_memory, page_size=4096,
            kv_layout="all-layers", enable_prefix_caching=config.enable_prefix_caching),
            SPEC, num_slots=config.max_num_seqs, max_model_len=config.max_model_len)
        self.model_config = model_config
        self.model_name = "marker stand-in"
        self.max_model_len = config.max_model_len
        self.dtype = torch.float32
        self.steps = 0

    def _cells(self, request_ids: list[str], context_lens: list[int], b: int,
               positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        k, _ = self.kv.layer_kv(0)  # [outer, inner, heads, head_dim]
        rows = self.kv.addressing(request_ids, context_lens).rows(
            np.full(len(positions), b), positions)
        inner = k.shape[1]
        return torch.as_tensor(rows // inner), torch.as_tensor(rows % inner)

    def execute(self, plan: StepPlan) -> StepOutput:
        self.steps += 1
        k, _ = self.kv.layer_kv(0)
        contexts: list[int] = []  # per input row: the last context token's row end
        row = 0
        histories: list[list[int]] = []
        for b, (rid, c, n) in enumerate(zip(plan.request_ids, plan.context_lens,
                                            plan.query_lens, strict=True)):
            outer, inner = self._cells(plan.request_ids, plan.context_lens, b, np.arange(c))
            cached = k[outer, inner, 0]  # [c, 2]
            assert torch.equal(cached[:, 1], torch.arange(c, dtype=k.dtype)), (
                f"{rid}: cached positions corrupted")
            history = [int(t) for t in cached[:, 0]] + plan.input_ids[row : row + n]
            outer, inner = self._cells(plan.request_ids, plan.context_lens, b,
                                       np.arange(c, c + n))
            k[outer, inner, 0] = torch.tensor(
                [[t, p] for t, p in zip(plan.input_ids[row : row + n],
                                        plan.positions[row : row + n], strict=True)],
                dtype=k.dtype)
            histories.append(history)
            contexts.extend([b] * n)
            row += n
        logits = torch.full((len(plan.sample_rows), self.model_config.vocab_size), -30.0)
        for i, sample_row in enumerate(plan.sample_rows):
            b = contexts[sample_row]
            want = next_token(histories[b])
            logits[i, want], logits[i, FIRST + (want - FIRST + 1) % SPAN] = 5.0, 4.0
        return StepOutput(logits if plan.sample_rows else None, [])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise AssertionError("no prompt logprobs are asked for here")


@pytest.fixture(scope="module")
def model_files(default_model: Any) -> tuple[Any, Any]:
    """The default model's config and tokenizer (its weights are never read)."""
    return load_model_config(default_model), load_tokenizer(default_model)


def engine_of(model_files: tuple[Any, Any], **options: Any) -> LLMEngine:
    options = {"max_model_len": 256, "max_num_seqs": 8, "max_num_batched_tokens": 64,
               "kv_cache_memory": 1 << 20, **options}
    config = EngineConfig(**options)
    model_config, tokenizer = model_files
    return LLMEngine(config, executor=MarkerExecutor(config, model_config), tokenizer=tokenizer)


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]
        ) -> dict[str, RequestOutput]:
    """Every request to its end; the whole final output of each (deltas added up, whole
    outputs as they come)."""
    sums = {rid: OutputAccumulator() for rid in requests}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    finals: dict[str, RequestOutput] = {}
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            deltas = requests[out.request_id][1].output_kind is DELTA
            if deltas:
                sums[out.request_id].add(out)
            if out.finished:
                finals[out.request_id] = sums[out.request_id].output() if deltas else out
        engine.kv.accounting.check()
    assert not engine.has_unfinished_requests() and set(finals) == set(requests)
    usage = engine.kv.accounting.usage
    assert usage.num_requests == 0 and usage.bytes_in_use == 0
    return finals


PROMPTS = {f"r{i}": [(7 * i + j) % 50 + 20 for j in range(12 + 9 * i)] for i in range(10)}
DELTA = RequestOutputKind.DELTA


@pytest.mark.parametrize("kv_mode", ["virtual", "paged"])
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preemption_under_tight_memory_keeps_every_token(
        model_files: tuple[Any, Any], kv_mode: str, preemption: str) -> None:
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, output_kind=DELTA)
    forked = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=20, ignore_eos=True,
                            output_kind=DELTA)
    requests = {**{rid: (p, params) for rid, p in PROMPTS.items()},
                "n3": (PROMPTS["r2"], forked)}
    ample = engine_of(model_files, kv_mode=kv_mode, preemption_mode=preemption)
    want = run(ample, requests)
    assert ample.scheduler.stats.num_preemptions == 0
    tight = engine_of(model_files, kv_mode=kv_mode, preemption_mode=preemption,
                      kv_cache_memory=300 * SPEC.bytes_per_token,
                      enable_prefix_caching=False)
    got = run(tight, requests)
    assert tight.scheduler.stats.num_preemptions > 0
    for rid in requests:
        assert [c.token_ids for c in got[rid].outputs] == [
            c.token_ids for c in want[rid].outputs], rid
        assert [c.text for c in got[rid].outputs] == [c.text for c in want[rid].outputs]
    first = want["r0"].outputs[0]
    assert len(first.token_ids) == 30 and first.finish_reason == "length"
    assert first.token_ids[0] == next_token(PROMPTS["r0"])  # the stand-in decided
    samples = [c.token_ids for c in want["n3"].outputs]
    assert len(samples) == 3 and len({tuple(s) for s in samples}) > 1


def test_outputs_stop_rules_and_kinds_without_a_model(model_files: tuple[Any, Any]) -> None:
    tokenizer = model_files[1]
    engine = engine_of(model_files)
    prompt = PROMPTS["r3"]
    plain = run(engine, {"a": (prompt, SamplingParams(temperature=0, max_tokens=40,
                                                      ignore_eos=True))})["a"].outputs[0]
    assert plain.text == tokenizer.decode(plain.token_ids)
    stop_id = plain.token_ids[5]
    stop_text = plain.text[10:14]
    cut = run(engine, {
        "by-id": (prompt, SamplingParams(temperature=0, max_tokens=40,
                                         stop_token_ids=[stop_id])),
        "by-text": (prompt, SamplingParams(temperature=0, max_tokens=40, stop=[stop_text])),
        "final": (prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                         output_kind=RequestOutputKind.FINAL_ONLY))})
    by_id = cut["by-id"].outputs[0]
    first = plain.token_ids.index(stop_id)
    assert by_id.token_ids == plain.token_ids[: first + 1] and by_id.stop_reason == stop_id
    assert by_id.text == tokenizer.decode(plain.token_ids[:first])  # its text left out
    by_text = cut["by-text"].outputs[0]
    assert by_text.text == plain.text[: plain.text.index(stop_text)]
    assert by_text.stop_reason == stop_text
    assert cut["final"].outputs[0].text == plain.text
    assert engine.counters.finished["stop"] == 2


class ScriptedTransport:
    """An engine loop's transport that hands out scripted commands: the next one when the
    loop asks, Abort of ``abort_id`` once the loop sent that request's first output, Stop once
    the script is spent and the engine is idle. Records every answer and every output."""

    def __init__(self, engine: LLMEngine, script: list[Command], abort_id: str) -> None:
        self.engine = engine
        self.script = script
        self.abort_id: str | None = abort_id
        self.answers: list[tuple[str, bool, Any]] = []
        self.outputs: list[RequestOutput] = []

    def receive(self, timeout: float) -> tuple[Command, Any] | None:
        if self.abort_id is not None and any(o.request_id == self.abort_id
                                             for o in self.outputs):
            command: Command = Abort(self.abort_id, "timeout")
            self.abort_id = None
        elif self.script:
            command = self.script.pop(0)
        elif not self.engine.has_unfinished_requests():
            command = Stop()
        else:
            return None
        name = type(command).__name__
        return command, lambda ok, value: self.answers.append((name, ok, value))

    def send(self, outputs: list[RequestOutput]) -> None:
        self.outputs.extend(outputs)


def test_the_engine_loop_answers_commands_and_sends_outputs(
        model_files: tuple[Any, Any]) -> None:
    want = run(engine_of(model_files), {"a": (PROMPTS["r1"], SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True))})["a"].outputs[0]
    engine = engine_of(model_files)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, output_kind=DELTA)
    script: list[Command] = [
        Add("a", PROMPTS["r1"], params),
        Add("a", PROMPTS["r2"], params),  # id in use
        Add("empty", [], params),
        Add("b", PROMPTS["r2"], replace(params, max_tokens=50)),
        Add("over", PROMPTS["r3"], params, max_waiting=0),  # a and b wait
        Call(lambda e: sorted(e.requests)),
    ]
    transport = ScriptedTransport(engine, script, abort_id="b")
    EngineLoop(engine, transport).run()

    oks = [(name, ok) for name, ok, _ in transport.answers]
    assert oks == [("Add", True), ("Add", False), ("Add", False), ("Add", True),
                   ("Add", False), ("Call", True), ("Abort", True)]
    errors = [value for _, ok, value in transport.answers if not ok]
    assert "already in use" in str(errors[0]) and "the prompt is empty" in str(errors[1])
    assert isinstance(errors[2], EngineOverloadedError)
    assert transport.answers[5][2] == ["a", "b"]
    a, b = OutputAccumulator(), OutputAccumulator()
    for out in transport.outputs:
        {"a": a, "b": b}[out.request_id].add(out)
    assert a.output().finished and a.output().outputs[0].token_ids == want.token_ids
    last_b = b.output().outputs[0]
    assert last_b.finish_reason == "abort" and last_b.stop_reason == "timeout"
    assert not engine.requests and engine.kv.accounting.usage.bytes_in_use == 0
