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
from pydantic import BaseModel, Field
from serving import client_of, serve
from test_server import MODEL, Running, wait_idle
from tool_model import QWEN_TOOL_TEMPLATE, save_qwen_tool_model

from vmkv import LLM, SamplingParams
from vmkv.config import EngineConfig
from vmkv.models import load_tokenizer
from vmkv.server.tool_parsers import (
    DeepSeekV3Parser,
    DeepSeekV31Parser,
    GraniteParser,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    PythonicParser,
    Qwen3CoderParser,
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
    assert isinstance(parser_for_template("<tool_call>\n<function=f>"), Qwen3CoderParser)
    assert isinstance(parser_for_template("<｜tool▁calls▁begin｜>```json"), DeepSeekV3Parser)
    assert type(parser_for_template("<｜tool▁calls▁begin｜>")) is DeepSeekV31Parser
    assert isinstance(parser_for_template("<|tool_call|>"), GraniteParser)
    assert parser_for_template("{{ messages }}") is None


def test_parsers_are_picked_from_named_templates() -> None:
    """Bug (2b6f1fc): a tokenizer with several named templates has a dict as its chat
    template; its substrings were tested, so no parser was found and every request with tools
    got a 400. The ``tool_use`` template is read, as transformers renders requests with tools
    with it (else ``default``)."""
    named = {"default": "{{ messages }}", "tool_use": "... <tool_call> ..."}
    assert isinstance(parser_for_template(named), HermesParser)
    assert isinstance(parser_for_template({"default": "[TOOL_CALLS]"}), MistralParser)
    assert parser_for_template({"default": "{{ messages }}"}) is None


HERMES_REPLY = ('I will look it up.\n<tool_call>\n{"name": "get_weather", "arguments": '
                '{"city": "Paris", "unit": "celsius"}}\n</tool_call>')
TWO_CALLS = ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
             '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>')
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


class Address(BaseModel):
    city: str = Field(min_length=1, max_length=12)
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(min_length=1, max_length=12)
    home: Address


def test_required_resolves_the_refs_of_nested_models(smol: Running) -> None:
    """Bug (2b6f1fc): a tool whose parameters are a pydantic model with a nested model
    (``$defs`` + ``$ref``) broke ``tool_choice: "required"``: the schema moved under
    ``properties.parameters`` and ``#/$defs/Address`` no longer resolved. The definitions are
    hoisted to the root, as vLLM does: the calls validate against the model's schema."""
    schema = Person.model_json_schema()
    assert "$defs" in schema
    tools = [*TOOLS, {"type": "function", "function": {"name": "save_person",
                                                       "parameters": schema}}]
    r = client_of(smol).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Save Ann, who lives in Oslo."}],
        tools=tools, tool_choice="required", parallel_tool_calls=False, temperature=0,
        max_tokens=120)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
    (call,) = r.choices[0].message.tool_calls
    schemas = {**SCHEMA_OF, "save_person": schema}
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_required_refuses_tools_that_define_a_name_twice(smol: Running) -> None:
    one = {"$defs": {"X": {"type": "integer"}}, "type": "object",
           "properties": {"x": {"$ref": "#/$defs/X"}}}
    two = {**one, "$defs": {"X": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": n, "parameters": p}}
             for n, p in (("one", one), ("two", two))]
    r = httpx.post(f"{smol.url}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": ASK, "tools": tools, "tool_choice": "required"})
    assert r.status_code == 400 and "$defs.X" in r.json()["error"]["message"], r.text


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


# -- markers that are special tokens, and named chat templates -----------------------------------
SPECIAL = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]")
PLAIN_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + "
                  "'<|im_end|>\\n' }}{% endfor %}{{ '<|im_start|>assistant\\n' }}")


@pytest.fixture(scope="module")
def special_path(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Path:
    """The Qwen-style model whose tokenizer holds the markers as special tokens (as Mistral's
    and some Qwen tokenizers do) and has named templates: ``default`` and ``tool_use``."""
    return save_qwen_tool_model(tmp_path_factory.mktemp("special-tools"), special=SPECIAL,
                                template={"default": PLAIN_TEMPLATE,
                                          "tool_use": QWEN_TOOL_TEMPLATE})


def forced_with_specials(path: Path, text: str) -> dict:
    """extra_body that makes the model write ``text`` with its markers as the special tokens
    (the regex allows them, a +100 bias picks them) and return its token ids."""
    vocab = load_tokenizer(path).get_vocab()
    return {**forced(text), "logit_bias": {str(vocab[m]): 100 for m in SPECIAL},
            "return_token_ids": True}


def test_special_token_markers_are_found_and_named_templates_read(special_path: Path) -> None:
    """Bugs (2b6f1fc): (1) a tool-call marker that is a special token was removed by the
    default ``skip_special_tokens``, so no call was ever found (the reply keeps special tokens
    while a parser reads it, as vLLM turns skip_special_tokens off); (2) a tokenizer with
    named templates (a dict) got a 400 for every request with tools (its ``tool_use``
    template now picks the parser: hermes)."""
    vocab = load_tokenizer(special_path).get_vocab()
    for running in serve_model(str(special_path)):
        client = client_of(running)
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                           max_tokens=80,
                                           extra_body=forced_with_specials(special_path,
                                                                           HERMES_REPLY))
        choice = r.choices[0]
        assert vocab["<tool_call>"] in choice.model_extra["token_ids"]  # the special token
        assert choice.finish_reason == "tool_calls", choice.message
        assert choice.message.content == "I will look it up."
        (call,) = choice.message.tool_calls
        assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
        stream = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, stream=True,
            extra_body=forced_with_specials(special_path, HERMES_REPLY))
        content, calls, finish = reassemble(stream)
        assert (content, finish, [c["name"] for c in calls]) == (
            "I will look it up.", "tool_calls", ["get_weather"])
        # without tools the reply is text: special tokens are dropped as the request asks
        plain = client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=80,
            extra_body=forced_with_specials(special_path, HERMES_REPLY))
        assert "<tool_call>" not in plain.choices[0].message.content


def test_mistral_special_token_calls_are_found(special_path: Path) -> None:
    """Bug (2b6f1fc): Mistral's ``[TOOL_CALLS]`` is a special token of its HF tokenizers, so
    ``auto`` calls were never detected under the default ``skip_special_tokens``."""
    reply = '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]'
    for running in serve_model(str(special_path), tool_call_parser="mistral"):
        client = client_of(running)
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                           max_tokens=60,
                                           extra_body=forced_with_specials(special_path, reply))
        choice = r.choices[0]
        assert load_tokenizer(special_path).get_vocab()["[TOOL_CALLS]"] in (
            choice.model_extra["token_ids"])
        assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
        (call,) = choice.message.tool_calls
        assert len(call.id) == 9 and json.loads(call.function.arguments) == {"a": 1, "b": 2}
