"""Tool calling in /v1/chat/completions with the real openai client: required and named calls
validate against the tools' schemas; auto parses a Qwen2-style model's <tool_call> (and Llama 3's
JSON) and round-trips; streamed tool-call deltas reassemble to the same calls."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import pytest
from serving import client_of, serve
from test_server import MODEL, Running, wait_idle
from tool_model import save_qwen_tool_model

from vmkv import LLM, SamplingParams
from vmkv.config import EngineConfig
from vmkv.server.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    PythonicParser,
    ToolCallParser,
    parser_for_template,
)

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 16},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                        "b": {"type": "integer", "minimum": -99, "maximum": 99}},
       "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "a + b",
                                           "parameters": ADD}}]
SCHEMA_OF = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def serve_model(model: str | None, **server: object) -> Iterator[Running]:
    yield from serve(EngineConfig(model=model, max_model_len=512, max_num_seqs=16), **server)


def assert_valid_calls(calls: list) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])


def reassemble(chunks: Iterator) -> tuple[str, list[dict], str | None]:
    """Content, calls and finish reason from streamed chat chunks, as OpenAI clients merge
    tool-call deltas (by index: id, type and name once, arguments concatenated)."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = d.id or call["id"]
            if d.function is not None:
                call["name"] = d.function.name or call["name"]
                call["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


# -- the parsers, on text ------------------------------------------------------------------------
def test_hermes_parser() -> None:
    p = HermesParser()
    text = ('Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": '
            '\\"Oslo\\"}"}\n</tool_call>')
    content, calls = p.parse(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"})]
    assert p.parse("no calls here") == ("no calls here", [])
    assert p.parse("<tool_call>{not json</tool_call>") == ("<tool_call>{not json</tool_call>",
                                                           [])
    # an unclosed last block (the reply hit EOS before </tool_call>) still parses
    assert p.parse('<tool_call>{"name": "add", "arguments": {}}')[1][0].name == "add"


def test_llama3_json_parser() -> None:
    p = Llama3JsonParser()
    content, calls = p.parse('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
                             '{"name": "get_weather", "parameters": {"city": "Rome"}}')
    assert content is None
    assert [c.name for c in calls] == ["add", "get_weather"]
    assert json.loads(calls[0].arguments) == {"a": 1, "b": 2}
    assert p.parse("Hello {there}") == ("Hello {there}", [])
    assert p.parse('{"name": "add"') == ('{"name": "add"', [])


def test_mistral_parser() -> None:
    p = MistralParser()
    content, calls = p.parse('Sure. [TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, '
                             '{"name": "get_weather", "arguments": {"city": "Rome"}}]')
    assert content == "Sure." and [c.name for c in calls] == ["add", "get_weather"]
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)  # what Mistral's templates take
    content, calls = p.parse('[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]add[ARGS]{"a": 2}')
    assert content is None and [json.loads(c.arguments) for c in calls] == [{"a": 1}, {"a": 2}]
    assert p.parse("[TOOL_CALLS][{broken") == ("[TOOL_CALLS][{broken", [])
    assert p.parse("no calls") == ("no calls", [])


def test_pythonic_parser() -> None:
    p = PythonicParser()
    content, calls = p.parse('[get_weather(city="Paris", unit="celsius"), add(a=-1, b=2.5), '
                             'f(flag=true, none=None, xs=[1, {"k": "v"}])]')
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("add", {"a": -1, "b": 2.5}),
        ("f", {"flag": True, "none": None, "xs": [1, {"k": "v"}]})]
    assert p.parse("<|python_start|>[f(x=1)]<|python_end|>")[1][0].name == "f"
    for text in ["[f(1)]", "[f(x=y)]", "[os.system(x='1')]", "Sure: [f(x=1)]", "[f(x=1)",
                 "[f(**k)]", "[]"]:
        assert p.parse(text) == (text, []), text


def test_parsers_are_picked_from_the_template() -> None:
    assert isinstance(parser_for_template("... <tool_call> ..."), HermesParser)
    assert isinstance(parser_for_template("... [TOOL_CALLS] ..."), MistralParser)
    assert isinstance(parser_for_template("<|python_start|> ... ipython"), PythonicParser)
    assert isinstance(parser_for_template("<|python_tag|>"), Llama3JsonParser)
    assert parser_for_template("{{ messages }}") is None


def test_streams_hold_back_what_may_become_a_tool_call() -> None:
    stream = HermesParser().stream()
    assert stream.feed("Sure, <tool", False) == [{"content": "Sure,"}]  # blanks held too
    assert stream.feed('_call>\n{"name": "add", "arguments": {"a": 1}}', False) == []
    deltas = stream.feed("\n</tool_call>", True)
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "add",
                                                      "arguments": '{"a": 1}'}
    plain = HermesParser().stream()
    assert plain.feed("a <t", False) == [{"content": "a"}]
    assert plain.feed("> c", True) == [{"content": " <t> c"}]
    llama = Llama3JsonParser().stream()
    assert llama.feed("  {", False) == []
    assert llama.feed('"name": "add", "parameters": {}}', True)[0]["tool_calls"][0]["index"] == 0


HERMES_REPLY = ('I will look it up.\n<tool_call>\n{"name": "get_weather", "arguments": '
                '{"city": "Paris", "unit": "celsius"}}\n</tool_call>')
TWO_CALLS = ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
             '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>')
REPLIES = [
    (HermesParser, HERMES_REPLY),
    (HermesParser, TWO_CALLS),
    (HermesParser, '  Two calls:  \n\n<tool_call>{"name": "add", "arguments": {"a": 1}}'
                   '</tool_call>\n<tool_call>{"name": "add", "arguments": {"b": 2}}'
                   '</tool_call>'),
    (HermesParser, "  plain text, kept as it is  \n"),
    (HermesParser, "broken <tool_call>{nope</tool_call>"),
    (Llama3JsonParser, '\n<|python_tag|>{"name": "add", "parameters": {"a": 1}}'),
    (Llama3JsonParser, "<|python hello"),
    (MistralParser, 'Let me see. \n[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}]'),
    (PythonicParser, ' [add(a=1), add(b=2)]'),
    (PythonicParser, "[not a call"),
]


@pytest.mark.parametrize(("parser", "text"), REPLIES)
@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("max_calls", [None, 1])
def test_streamed_replies_merge_to_the_non_streamed_reply(
        parser: type[ToolCallParser], text: str, chunk: int, max_calls: int | None) -> None:
    """The streamed content is the non-streamed content, trimmed the same way, whatever the
    chunks; the calls are the same (at most max_calls: parallel_tool_calls false)."""
    content, calls = parser().parse(text)
    stream = parser().stream(max_calls)
    deltas = []
    for i in range(0, len(text), chunk):
        deltas += stream.feed(text[i : i + chunk], False)
    deltas += stream.feed("", True)
    streamed = "".join(d.get("content", "") for d in deltas)
    assert streamed == (content or "")
    streamed_calls = [d["tool_calls"][0]["function"] for d in deltas if "tool_calls" in d]
    assert streamed_calls == [c.as_dict()["function"] for c in calls][:max_calls]
    assert all(d["tool_calls"][0]["index"] == i for i, d in enumerate(
        d for d in deltas if "tool_calls" in d))


def test_streaming_scans_only_the_new_text() -> None:
    """Each chunk costs its own length: the stream never rescans the whole reply."""
    parser = HermesParser()
    seen: list[int] = []
    scan = parser.scan

    def counting(text: str, start: int):  # noqa: ANN202
        seen.append(len(text) - max(0, start - len(parser.MARKER) + 1))
        return scan(text, start)

    parser.scan = counting  # type: ignore[method-assign]
    stream = parser.stream()
    for _ in range(2000):
        stream.feed("word ", False)
    assert max(seen) <= len("word ") + len(parser.MARKER)


# -- required and named, on the default model ----------------------------------------------------
@pytest.fixture(scope="module")
def smol(default_model: Path) -> Iterator[Running]:
    yield from serve_model(None)


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_weather"}},
    {"type": "function", "function": {"name": "add"}}])
def test_required_and_named_calls_always_validate(smol: Running, tool_choice: object) -> None:
    client = client_of(smol)
    for seed in range(4):
        r = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice,
            parallel_tool_calls=False, temperature=0.8, seed=seed, max_tokens=100)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        assert choice.message.content is None
        assert_valid_calls(choice.message.tool_calls)
        if isinstance(tool_choice, dict):
            assert [c.function.name for c in choice.message.tool_calls] == [
                tool_choice["function"]["name"]]
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, temperature=0.8,
        seed=0, max_tokens=100, parallel_tool_calls=False, stream=True)
    content, calls, finish = reassemble(stream)
    assert content == "" and finish == "tool_calls" and len(calls) == 1
    assert calls[0]["id"].startswith("call_")
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMA_OF[calls[0]["name"]])
    assert wait_idle(smol.url)["vmkv:kv_physical_bytes_in_use"] == 0


def test_required_allows_several_calls_by_default(smol: Running) -> None:
    """Without ``parallel_tool_calls: false`` the grammar is an array of one or more calls:
    sampled answers to a request for two sums include one with several valid calls (greedy,
    this model repeats calls until ``max_tokens``). Seeds in batches until one has them."""
    client = client_of(smol)
    ask = [{"role": "user", "content": "Add 1 and 2, then add 3 and 4."}]

    def answer(seed: int) -> list:
        r = client.chat.completions.create(
            model=MODEL, messages=ask, tools=TOOLS, tool_choice="required", temperature=1.0,
            seed=seed, max_tokens=300)
        choice = r.choices[0]
        if choice.finish_reason == "length":  # an array still open: no calls to check
            return []
        assert choice.finish_reason == "tool_calls", choice.message
        assert_valid_calls(choice.message.tool_calls)
        return choice.message.tool_calls

    most = 0
    with ThreadPoolExecutor(8) as pool:
        for first in range(0, 32, 8):  # 1 in 4 answers had several calls (seeds 0-15)
            seeds = range(first, first + 8)
            most = max(most, *(len(calls) for calls in pool.map(answer, seeds)))
            if most >= 2:
                break
    assert most >= 2


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope'"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be one of"),
    ({"tools": [{"type": "function"}]}, "tools.0", "each tool"),
    ({"tools": TOOLS}, "tool_choice", "'auto' needs a chat template"),  # SmolLM2 has none
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "already constrains"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"not": {}}}}}}], "tool_choice": "required"},
     "tool_choice", "'not'"),
])
def test_bad_tool_requests_are_400s(smol: Running, body: dict, param: str,
                                    message: str) -> None:
    r = httpx.post(f"{smol.url}/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": ASK, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and message in r.json()["error"]["message"]


# -- auto, on a Qwen2-style model whose template teaches <tool_call> -----------------------------
@pytest.fixture(scope="module")
def qwen_path(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Path:
    return save_qwen_tool_model(tmp_path_factory.mktemp("qwen-tools"))


@pytest.fixture(scope="module")
def qwen(qwen_path: Path) -> Iterator[Running]:
    yield from serve_model(str(qwen_path))


def forced(text: str) -> dict:
    """extra_body that makes the random model write exactly ``text`` (a regex of it)."""
    pattern = re.sub(r"[\\{}\[\]().*+?|^$]", lambda m: "\\" + m.group(), text)
    return {"structured_outputs": {"regex": pattern.replace("\n", "\\n")}}


def test_auto_parses_hermes_tool_calls_and_round_trips(qwen: Running) -> None:
    client = client_of(qwen)
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80,
                                       extra_body=forced(HERMES_REPLY))
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I will look it up."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}

    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                            max_tokens=80, stream=True,
                                            extra_body=forced(HERMES_REPLY))
    content, calls, finish = reassemble(stream)
    assert finish == "tool_calls" and content == "I will look it up."  # trimmed as above
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (call.function.name, json.loads(call.function.arguments))]

    # the round trip: the call and its result go back through the template
    history = [*ASK, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    tokenized = httpx.post(f"{qwen.url}/tokenize", json={"messages": history}).json()
    prompt = httpx.post(f"{qwen.url}/detokenize", json={"tokens": tokenized["tokens"]}).json()
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
            '"celsius"}}\n</tool_call>') in prompt["prompt"]
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in prompt["prompt"]
    final = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                           max_tokens=20, extra_body=forced("It is 21 C."))
    assert final.choices[0].message.content == "It is 21 C."
    assert final.choices[0].finish_reason == "stop" and not final.choices[0].message.tool_calls


def test_auto_without_a_call_is_plain_content(qwen: Running) -> None:
    client = client_of(qwen)
    text = "Paris is sunny <today>."
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=20,
                                       extra_body=forced(text))
    assert r.choices[0].message.content == text and r.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                            max_tokens=20, stream=True, extra_body=forced(text))
    assert reassemble(stream) == (text, [], "stop")
    none = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                          tool_choice="none", max_tokens=120,
                                          extra_body=forced(HERMES_REPLY))
    assert none.choices[0].message.content == HERMES_REPLY  # none: text, never parsed
    # ... but the tools are in the prompt, as vLLM renders them
    assert none.usage.prompt_tokens == r.usage.prompt_tokens
    bare = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)
    assert none.usage.prompt_tokens > bare.usage.prompt_tokens + 50


def test_parallel_tool_calls_false_keeps_the_first_call(qwen: Running) -> None:
    client = client_of(qwen)
    both = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200,
                                          extra_body=forced(TWO_CALLS))
    assert [json.loads(c.function.arguments) for c in both.choices[0].message.tool_calls] == [
        {"a": 1, "b": 2}, {"a": 3, "b": 4}]
    one = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200,
                                         parallel_tool_calls=False, extra_body=forced(TWO_CALLS))
    (call,) = one.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"a": 1, "b": 2}
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                            max_tokens=200, parallel_tool_calls=False,
                                            stream=True, extra_body=forced(TWO_CALLS))
    content, calls, finish = reassemble(stream)
    assert (content, finish, len(calls)) == ("", "tool_calls", 1)
    assert json.loads(calls[0]["arguments"]) == {"a": 1, "b": 2}


def test_auto_with_the_llama3_json_parser(qwen_path: Path) -> None:
    for running in serve_model(str(qwen_path), tool_call_parser="llama3_json"):
        client = client_of(running)
        reply = '{"name": "add", "parameters": {"a": 2, "b": 40}}'
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                           max_tokens=40, extra_body=forced(reply))
        assert r.choices[0].finish_reason == "tool_calls"
        (call,) = r.choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("add",
                                                                              {"a": 2, "b": 40})
        stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                                max_tokens=40, stream=True,
                                                extra_body=forced(reply))
        content, calls, finish = reassemble(stream)
        assert (content, finish) == ("", "tool_calls")
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
            ("add", {"a": 2, "b": 40})]


def test_the_offline_chat_renders_tools(qwen_path: Path) -> None:
    llm = LLM(str(qwen_path), max_model_len=512)
    text = llm.tokenizer.decode(llm.apply_chat_template(ASK, tools=TOOLS))
    assert "<tools>" in text and '"name": "get_weather"' in text
    assert "<tools>" not in llm.tokenizer.decode(llm.apply_chat_template(ASK))
    out = llm.chat(ASK, SamplingParams(max_tokens=3), tools=TOOLS, use_tqdm=False)[0]
    assert out.prompt_token_ids == llm.apply_chat_template(ASK, tools=TOOLS)
