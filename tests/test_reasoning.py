"""Reasoning parsers (``--reasoning-parser``): the thinking split into ``reasoning`` and
``reasoning_content`` in chat messages and streamed deltas (the same split, whatever the
chunks), ``include_reasoning``, Responses reasoning items and ``reasoning.effort``, and
structured outputs that apply once the thinking ends (the engine's grammar waits for the
closing token). The default model has no thinking tokens: a random model whose tokenizer
holds ``<think>`` / ``</think>`` as special tokens stands in, its (tiny, random) logits steered
by logit biases and penalties, its answers forced by structured outputs."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from serving import client_of, serve
from test_server import MODEL, Running
from tool_model import save_qwen_tool_model

from vmkv import LLM, SamplingParams
from vmkv.config import EngineConfig
from vmkv.models import load_tokenizer, resolve_model
from vmkv.server.reasoning import (
    REASONING_PARSERS,
    DeepSeekR1Parser,
    GraniteParser,
    Qwen3Parser,
    ReasoningStream,
    reasoning_parser,
)

#: a chat template that closes the thinking in the prompt when it is turned off (as Qwen3's),
#: and shows reasoning_effort and earlier reasoning (as reasoning models' templates do)
TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
    "{% if m.reasoning_content %}{{ '<think>' + m.reasoning_content + '</think>' }}{% endif %}"
    "{{ m.content + '<|im_end|>\\n' }}{% endfor %}"
    "{% if reasoning_effort is defined %}{{ 'effort: ' + reasoning_effort + '\\n' }}{% endif %}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}")
ASK = [{"role": "user", "content": "What is the capital of France?"}]


# -- the parsers, on text ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def think_path(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Path:
    return save_qwen_tool_model(tmp_path_factory.mktemp("think"), special=("<think>",
                                "</think>"), template=TEMPLATE, scale=0.01)


@pytest.fixture(scope="module")
def tokenizer(think_path: Path) -> object:
    return load_tokenizer(think_path)


SPLITS = [
    (DeepSeekR1Parser, "<think>\nLet me see.\n</think>\n\nParis.",
     ("\nLet me see.\n", "\n\nParis.")),
    (DeepSeekR1Parser, "  <think>a</think>", ("a", None)),
    (DeepSeekR1Parser, "Opened in the prompt.</think>Paris", ("Opened in the prompt.", "Paris")),
    (DeepSeekR1Parser, "Still thinking when cut", ("Still thinking when cut", None)),
    (DeepSeekR1Parser, "a</think>b</think>c", ("a", "b</think>c")),
    (Qwen3Parser, "<think>x < y</think>\nYes", ("x < y", "\nYes")),
    (GraniteParser, "Here is my thought process: It is Paris. Here is my response: Paris.",
     (" It is Paris. ", " Paris.")),
    (GraniteParser, "Here's my thought process: hmm", (" hmm", None)),
    (GraniteParser, "Paris, directly.", (None, "Paris, directly.")),
    (GraniteParser, "Here is my answer", (None, "Here is my answer")),
]


@pytest.mark.parametrize(("parser", "text", "split"), SPLITS)
def test_the_split_and_its_stream_agree_whatever_the_chunks(
        parser: type, text: str, split: tuple, tokenizer: object) -> None:
    p = parser(tokenizer)
    assert p.split(text) == split
    rng = random.Random(len(text))
    for cuts in [list(range(1, len(text))), sorted(rng.sample(range(1, len(text)), 5)), []]:
        stream, reasoning, content, at = ReasoningStream(p), "", "", 0
        for cut in [*cuts, len(text)]:
            r, c = stream.feed(text[at:cut], cut == len(text))
            reasoning, content, at = reasoning + r, content + c, cut
        assert (reasoning if stream.opened else None, content or None) == split


def test_the_stream_holds_back_only_what_may_be_a_marker(tokenizer: object) -> None:
    stream = ReasoningStream(DeepSeekR1Parser(tokenizer))
    assert stream.feed("<thi", False) == ("", "")
    assert stream.feed("nk>Hmm, </th", False) == ("Hmm, ", "")
    assert stream.feed("ink>Par", False) == ("", "Par")
    assert stream.feed("is", True) == ("", "is")


def test_a_prompt_that_closed_the_thinking_leaves_the_reply_content(tokenizer: object) -> None:
    vocab = tokenizer.get_vocab()
    start, end = vocab["<think>"], vocab["</think>"]
    r1, qwen3 = DeepSeekR1Parser(tokenizer), Qwen3Parser(tokenizer)
    assert r1.thinks([1, 2, start], {}) and r1.thinks([1, 2], {})
    assert not r1.thinks([1, start, 5, end, 9], {})
    assert r1.thinks([start, end, 3, start], {})  # an earlier turn's, then a new opening
    assert not qwen3.thinks([1, 2], {"enable_thinking": False}) and qwen3.thinks([1], {})
    assert r1.count_tokens([start, 7, 8, end, 9]) == 2 and r1.count_tokens([7, 8]) == 2


def test_parsers_need_their_tokens() -> None:
    plain = load_tokenizer(resolve_model(None, progress=False))
    with pytest.raises(ValueError, match="needs <think> and </think> as tokens"):
        reasoning_parser("deepseek_r1", plain)
    with pytest.raises(ValueError, match="must be one of"):
        reasoning_parser("nope", plain)
    assert isinstance(reasoning_parser("granite", plain), GraniteParser)  # text markers
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3", "granite"}


# -- the engine: structured outputs once the thinking ends ---------------------------------------
def test_the_grammar_waits_for_the_end_of_the_thinking(think_path: Path) -> None:
    """With ``structured_outputs_after`` the grammar constrains nothing (and sees nothing)
    until the closing token, then applies; without it, the closing token is forbidden at once
    (its text is outside the regex)."""
    llm = LLM(str(think_path), max_model_len=256)
    end = llm.tokenizer.get_vocab()["</think>"]
    common = dict(temperature=0, max_tokens=12, skip_special_tokens=False,
                  logit_bias={end: 100}, structured_outputs={"regex": "Paris\\."})
    after, now = llm.generate(["Capital?", "Capital?"], [
        SamplingParams(**common, structured_outputs_after=end), SamplingParams(**common)],
        use_tqdm=False)
    assert after.outputs[0].token_ids[0] == end
    assert after.outputs[0].text == "</think>Paris."
    assert now.outputs[0].text == "Paris." and end not in now.outputs[0].token_ids
    with pytest.raises(ValueError, match="needs structured_outputs"):
        SamplingParams(structured_outputs_after=end)


# -- the server ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def r1(think_path: Path) -> Iterator[Running]:
    yield from serve(EngineConfig(model=str(think_path), max_model_len=512, max_num_seqs=4),
                     reasoning_parser="deepseek_r1")


def steered(tokenizer: object, content: str, **extra: object) -> dict:
    """extra_body that makes the random model (logits near 0) think two words (" Hmm ok"),
    close the thinking and answer ``content``: the words and the closing token carry falling
    biases (12, 11, 10), and a token once written drops 4 (presence + frequency penalties)
    below its bias; the answer is forced by a regex that applies after the thinking."""
    vocab = tokenizer.get_vocab()
    (hmm,), (ok,) = (tokenizer.encode(word, add_special_tokens=False) for word in (" Hmm",
                                                                                  " ok"))
    return {"logit_bias": {str(hmm): 12, str(ok): 11, str(vocab["</think>"]): 10},
            "presence_penalty": 2, "frequency_penalty": 2, "temperature": 0,
            "structured_outputs": {"regex": content.replace(".", "\\.")}, **extra}


def reassemble(chunks: Iterator) -> tuple[str, str, list]:
    reasoning, content, finishes = "", "", []
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta.model_extra
            reasoning += delta.get("reasoning") or ""
            assert delta.get("reasoning") == delta.get("reasoning_content")
            content += choice.delta.content or ""
            finishes.append(choice.finish_reason)
    return reasoning, content, finishes


def test_chat_splits_the_reasoning(r1: Running, tokenizer: object) -> None:
    client = client_of(r1)
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20,
                                       extra_body=steered(tokenizer, "Paris."))
    message = r.choices[0].message
    assert message.model_extra["reasoning"] == message.model_extra["reasoning_content"] == (
        " Hmm ok")
    assert message.content == "Paris." and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens_details.reasoning_tokens == 2
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=20, stream=True,
        stream_options={"include_usage": True}, extra_body=steered(tokenizer, "Paris."))
    chunks = list(stream)
    assert reassemble(chunks)[:2] == (" Hmm ok", "Paris.")
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 2
    # include_reasoning false: no reasoning, nor the logprobs that would show it
    hidden = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=20, logprobs=True,
        extra_body=steered(tokenizer, "Paris.", include_reasoning=False))
    assert hidden.choices[0].message.content == "Paris."
    assert hidden.choices[0].message.model_extra["reasoning"] is None
    assert hidden.choices[0].logprobs is None
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=20, stream=True,
        extra_body=steered(tokenizer, "Paris.", include_reasoning=False))
    assert reassemble(stream)[:2] == ("", "Paris.")


def test_a_prompt_that_closed_the_thinking_gets_content_and_the_grammar_at_once(
        r1: Running, tokenizer: object) -> None:
    r = client_of(r1).chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=20,
        extra_body=steered(tokenizer, "Paris.",
                           chat_template_kwargs={"enable_thinking": False}))
    message = r.choices[0].message
    assert (message.content, message.model_extra["reasoning"]) == ("Paris.", None)
    assert r.usage.completion_tokens_details.reasoning_tokens == 0


def test_tools_are_read_after_the_reasoning(r1: Running, tokenizer: object) -> None:
    tools = [{"type": "function", "function": {"name": "capital", "parameters": {
        "type": "object", "properties": {"country": {"type": "string", "maxLength": 8}},
        "required": ["country"]}}}]
    body = steered(tokenizer, "x")
    del body["structured_outputs"]  # the named tool's schema applies after the thinking
    r = client_of(r1).chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=40, tools=tools,
        tool_choice={"type": "function", "function": {"name": "capital"}}, extra_body=body)
    message = r.choices[0].message
    assert message.model_extra["reasoning"] == " Hmm ok"
    (call,) = message.tool_calls
    assert call.function.name == "capital" and "country" in json.loads(call.function.arguments)


def test_responses_reasoning_items_and_effort(r1: Running) -> None:
    """A reasoning item before the message (here the random model never closes its thinking:
    the reply is all reasoning), the same streamed as not; ``reasoning.effort`` reaches the
    template; an earlier reasoning item goes back as the message's reasoning_content."""
    client = client_of(r1)
    r = client.responses.create(model=MODEL, input="Capital of France?", temperature=0,
                                max_output_tokens=6, reasoning={"effort": "low",
                                                                "summary": "auto"})
    (item,) = r.output
    assert item.type == "reasoning" and item.content[0].type == "reasoning_text"
    assert item.content[0].text and item.summary == [] and r.status == "incomplete"
    assert r.usage.output_tokens_details.reasoning_tokens == 6
    plain = client.responses.create(model=MODEL, input="Capital of France?", temperature=0,
                                    max_output_tokens=6)
    assert r.usage.input_tokens > plain.usage.input_tokens  # "effort: low" in the prompt
    events = list(client.responses.create(
        model=MODEL, input="Capital of France?", temperature=0, max_output_tokens=6,
        reasoning={"effort": "low"}, stream=True))
    kinds = [e.type for e in events]
    assert kinds[2:5] == ["response.output_item.added", "response.content_part.added",
                          "response.reasoning_text.delta"]
    assert "response.reasoning_text.done" in kinds
    done = events[-1].response
    assert [o.model_dump(exclude={"id"}) for o in done.output] == [
        o.model_dump(exclude={"id"}) for o in r.output]
    again = client.responses.create(model=MODEL, temperature=0, max_output_tokens=2, input=[
        {"role": "user", "content": "Capital of France?"},
        {"type": "reasoning", "id": item.id, "summary": [],
         "content": [{"type": "reasoning_text", "text": "It is Paris."}]},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"}])
    shorter = client.responses.create(model=MODEL, temperature=0, max_output_tokens=2, input=[
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"}])
    assert again.usage.input_tokens > shorter.usage.input_tokens  # <think>It is Paris.</think>
    bad = httpx.post(f"{r1.url}/v1/responses", timeout=30, json={
        "model": MODEL, "input": "Hi", "reasoning": {"effort": "extreme"}})
    assert bad.status_code == 400 and "reasoning.effort" in bad.json()["error"]["message"]


def test_granite_splits_text_markers(default_model: Path) -> None:
    """Granite's markers are text: its reasoning needs no special token, and (with no closing
    token to wait for) structured outputs apply from the first token, which here force the
    whole reply."""
    reply = "Here is my thought process: It is Paris. Here is my response: Paris."
    pattern = reply.replace(".", "\\.")
    for running in serve(EngineConfig(max_model_len=512, max_num_seqs=4),
                         reasoning_parser="granite"):
        client = client_of(running)
        body = {"structured_outputs": {"regex": pattern}}
        r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40,
                                           extra_body=body)
        message = r.choices[0].message
        assert (message.model_extra["reasoning_content"], message.content) == (
            " It is Paris. ", " Paris.")
        stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40,
                                                stream=True, extra_body=body)
        assert reassemble(stream)[:2] == (" It is Paris. ", " Paris.")
        with pytest.raises(openai.BadRequestError):  # the field table's refusals still hold
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4,
                                           extra_body={"thinking_token_budget": 10})
