"""The engine's output side without a model (the real tokenizer): deltas add up to the whole
output in every output kind, a step keeps only what it has not emitted, vLLM's stop semantics,
and the accumulator that merges deltas."""

from __future__ import annotations

from typing import Any

import pytest

from vmkv.engine.output_processor import OutputProcessor
from vmkv.engine.outputs import (
    CompletionOutput,
    OutputAccumulator,
    RequestMetrics,
    RequestOutput,
)
from vmkv.engine.sequence import Request, SeqStatus, Sequence
from vmkv.models import load_tokenizer
from vmkv.sampling_params import RequestOutputKind, SamplingParams

KINDS = list(RequestOutputKind)
TEXT = "Once upon a time, the café served 🍰 cake and tea. The end. Then more text."


@pytest.fixture(scope="module")
def tokenizer(default_model: Any) -> Any:
    return load_tokenizer(default_model)


class Run:
    """One request through an :class:`OutputProcessor`, tokens appended by hand."""

    def __init__(self, tokenizer: Any, params: SamplingParams, n: int = 1) -> None:
        self.eos = tokenizer.eos_token_id
        self.proc = OutputProcessor(tokenizer, (self.eos,), max_model_len=4096, device="cpu")
        ids = tokenizer("Tell me a story:").input_ids
        self.req = Request("r", ids, params, params.max_tokens or 1000, prompt="Tell me")
        seq = self.proc.new_request(self.req, None)
        seq.pending_forks = n - 1
        self.outputs: list[RequestOutput] = []

    @property
    def seqs(self) -> list[Sequence]:
        return self.req.seqs

    def step(self, tokens: list[int]) -> None:
        """Sample ``tokens[i]`` for sequence i (forking after the first step)."""
        first = self.seqs[0]
        if first.pending_forks:
            self.proc.fork(first)
            first.pending_forks = 0
        for seq, token in zip(self.seqs, tokens, strict=True):
            if seq.is_finished:
                continue
            reason = self.proc.append(seq, token, -0.5, [(token, -0.5), (7, -3.0)])
            if reason is not None:
                seq.finish_reason, seq.status = reason, SeqStatus.FINISHED
        out = self.proc.output(self.req)
        if out is not None:
            self.outputs.append(out)

    def finish(self, reason: str = "abort") -> None:
        for seq in self.seqs:
            if not seq.is_finished:
                seq.finish_reason, seq.status = reason, SeqStatus.FINISHED
        out = self.proc.output(self.req)
        if out is not None:
            self.outputs.append(out)

    def whole(self) -> RequestOutput:
        """The request's whole output, as its kind delivers it."""
        if self.req.params.output_kind is RequestOutputKind.DELTA:
            total = OutputAccumulator()
            for out in self.outputs:
                total.add(out)
            return total.output()
        return self.outputs[-1]


@pytest.mark.parametrize("kind", KINDS)
def test_every_output_kind_gives_the_same_whole_output(tokenizer: Any,
                                                      kind: RequestOutputKind) -> None:
    tokens = tokenizer(TEXT).input_ids
    params = SamplingParams(n=2, stop=["The end"], logprobs=1, max_tokens=100,
                            output_kind=kind)
    run = Run(tokenizer, params, n=2)
    for i, token in enumerate(tokens):
        run.step([token, tokens[min(i + 3, len(tokens) - 1)]])  # two different samples
        if run.req.is_finished:
            break
    else:
        run.finish("length")
    whole = run.whole()
    assert whole.finished and whole.prompt_token_ids == run.req.prompt_token_ids
    first, second = whole.outputs
    assert first.text == TEXT[: TEXT.index("The end")]  # cut before the stop string
    assert first.finish_reason == "stop" and first.stop_reason == "The end"
    assert first.token_ids == run.seqs[0].output_token_ids
    assert [set(e) for e in first.logprobs] == [{t, 7} for t in first.token_ids]
    assert second.index == 1 and second.token_ids == run.seqs[1].output_token_ids
    if kind is RequestOutputKind.FINAL_ONLY:
        assert len(run.outputs) == 1  # nothing until the end
    if kind is RequestOutputKind.DELTA:
        assert len(run.outputs) > 1
        assert all(out.prompt_token_ids is None for out in run.outputs[1:])  # first only
        assert all(len(c.token_ids) <= 1 for out in run.outputs for c in out.outputs)


def test_a_running_sequence_keeps_only_the_text_it_holds_back(tokenizer: Any) -> None:
    """Per step the engine touches what the step added: after thousands of tokens a sequence
    holds at most the characters a stop string could still begin with, plus the last piece."""
    tokens = tokenizer(TEXT * 60).input_ids
    run = Run(tokenizer, SamplingParams(stop=["NEVER MATCHES"], max_tokens=len(tokens) + 1,
                                        output_kind=RequestOutputKind.DELTA))
    hold = len("NEVER MATCHES") - 1
    for token in tokens:
        run.step([token])
        seq = run.seqs[0]
        assert len(seq.output.unsent_text) <= hold
        assert not seq.output.unsent_logprobs
    run.finish()
    assert run.whole().outputs[0].text == TEXT * 60  # the held-back tail comes at the end


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_text_is_returned_only_when_asked(tokenizer: Any, include: bool) -> None:
    """vLLM's semantics: the text of the EOS or stop token that ends a sequence is left out
    unless ``include_stop_str_in_output``; its id is in ``token_ids`` either way."""
    body = tokenizer("Hello world.").input_ids
    stop_token = tokenizer(" Stop").input_ids[-1]
    for last, reason in ((None, None), (stop_token, stop_token)):  # EOS, then a stop token id
        params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include,
                                stop_token_ids=[stop_token], max_tokens=50)
        run = Run(tokenizer, params)
        last = run.eos if last is None else last
        for token in [*body, last]:
            run.step([token])
        out = run.whole().outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == reason
        assert out.token_ids == [*body, last]
        expected = tokenizer.decode([*body, last]) if include else tokenizer.decode(body)
        assert out.text == expected


def test_min_tokens_defers_stop_strings_and_tokens(tokenizer: Any) -> None:
    tokens = tokenizer("a. b. c. d.").input_ids
    run = Run(tokenizer, SamplingParams(stop=["."], min_tokens=4, max_tokens=50))
    for token in tokens:
        run.step([token])
        if run.req.is_finished:
            break
    out = run.whole().outputs[0]
    assert out.finish_reason == "stop" and len(out.token_ids) >= 4
    assert out.text == tokenizer.decode(out.token_ids).rsplit(".", 1)[0]


def test_unread_deltas_merge_into_one() -> None:
    metrics = RequestMetrics(0.0)

    def delta(text: str, ids: list[int], finish: str | None = None,
              prompt: list[int] | None = None) -> RequestOutput:
        return RequestOutput("r", None, prompt, [CompletionOutput(0, text, ids, finish)],
                             finish is not None, metrics)

    unread = OutputAccumulator()
    assert not unread
    with pytest.raises(ValueError, match="no output"):
        unread.take()
    unread.add(delta("Hel", [1], prompt=[9, 9]))
    unread.add(delta("lo", [2]))
    merged = unread.take()
    assert not unread  # taken: it starts again
    assert merged.outputs[0].text == "Hello" and merged.outputs[0].token_ids == [1, 2]
    assert merged.prompt_token_ids == [9, 9] and not merged.finished
    unread.add(delta("!", [3], "stop"))
    last = unread.take()
    assert last.prompt_token_ids is None and last.finished
    assert last.outputs[0].text == "!" and last.outputs[0].finish_reason == "stop"
