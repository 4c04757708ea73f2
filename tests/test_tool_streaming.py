"""Tool calls streamed as vLLM streams them: a call's first delta carries its id, type and name,
the next ones fragments of its arguments, as they arrive; merged, the deltas are exactly the
non-streamed reply (content and calls), whatever the chunks, for every parser. Then the real
openai client against a real server sees the argument deltas before the end."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from serving import client_of, serve
from test_server import MODEL, Running
from tool_model import save_qwen_tool_model

from vmkv.config import EngineConfig
from vmkv.server.tool_parsers import (
    PARSERS,
    DeepSeekV3Parser,
    DeepSeekV31Parser,
    GraniteParser,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    PythonicParser,
    Qwen3CoderParser,
    ToolCallParser,
    ToolCallStream,
    XlamParser,
    load_plugin,
)
from vmkv.server.tool_parsers.json_stream import JsonValueStream
from vmkv.server.tools import RequiredCalls

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "hourly": {"type": "boolean"},
                                     "where": {"type": "object"}, "note": {}}}}}]
HERMES = ('I will look it up.\n<tool_call>\n{"name": "get_weather", "arguments": '
          '{"city": "Par\\u00eds \\"Nord\\"", "days": 3, "hourly": true}}\n</tool_call>')
DS = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
DS_END = "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
REPLIES: list[tuple[type[ToolCallParser], str]] = [
    (HermesParser, HERMES),
    (HermesParser, '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
                   '<tool_call>\n{"arguments": {"a": -3.50, "b": [4e2, null]}, "name": "add"}'
                   '\n</tool_call>'),
    (HermesParser, '  Two calls:  \n\n<tool_call>{"name": "add", "arguments": {"a": 1}}'
                   '</tool_call>\n<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}'
                   '</tool_call>'),
    (HermesParser, '<tool_call>{"name": "noargs"}</tool_call>'),
    (HermesParser, "  plain text, kept as it is  \n"),
    (HermesParser, "broken <tool_call>{nope</tool_call> and more text"),
    (Llama3JsonParser, '\n<|python_tag|>{"name": "add", "parameters": {"a": 1}}; '
                       '{"name": "f", "parameters": {"s": "\\ud83d\\ude00"}}'),
    (Llama3JsonParser, "<|python hello"),
    (MistralParser, 'Let me see. \n[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, '
                    '{"name": "get_weather", "arguments": {"city": "Rome"}}]'),
    (MistralParser, '[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]add[CALL_ID]abc123XYZ[ARGS]'
                    '{"a": [2, {"b": "c"}]}'),
    (PythonicParser, ' [add(a=1, b="x, (y)"), get_weather(city=\'Oslo\', days=-2, hourly=True,'
                     ' where={"lat": 1.5, "k": [None, false]}), noargs()]'),
    (PythonicParser, '<|python_start|>[f(x="""tri"ple""")]<|python_end|>'),
    (PythonicParser, "[not a call"),
    (Qwen3CoderParser, 'Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n'
                       '</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=hourly>\n'
                       'True\n</parameter>\n<parameter=where>\n{"lat": 40.7}\n</parameter>\n'
                       '<parameter=other>\n1 < 2\n</parameter>\n</function>\n</tool_call>'),
    (Qwen3CoderParser, '<tool_call>\n<function=noargs>\n</function>\n</tool_call>\n<tool_call>\n'
                       '<function=get_weather>\n<parameter=note>\n[1, "a"]\n</parameter>\n'
                       '</function>\n</tool_call>'),
    (DeepSeekV3Parser, f'Checking.{DS}function<｜tool▁sep｜>get_weather\n```json\n'
                       f'{{"city": "Paris"}}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>'
                       f'function<｜tool▁sep｜>add\n```json\n{{"a": 1}}\n```{DS_END}'),
    (DeepSeekV31Parser, f'{DS}get_weather<｜tool▁sep｜>{{"city": "Paris"}}{DS_END}'),
    (GraniteParser, '<|tool_call|>[{"name": "add", "arguments": {"a": 1}}, '
                    '{"name": "get_weather", "arguments": {"city": "Rome"}}]'),
    (GraniteParser, "No tools needed."),
    (XlamParser, '[{"name": "add", "arguments": {"a": 1}}]'),
    (XlamParser, 'Calling:\n```json\n[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
                 '\n```'),
    (XlamParser, "A code block:\n```python\nprint(1)\n```"),
    (RequiredCalls, '[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "get_weather",'
                    ' "parameters": {"city": "Lyon", "unit": "celsius"}}]'),
]


def merge(deltas: list[dict]) -> tuple[str, list[dict]]:
    """Content and calls from deltas, as OpenAI clients merge them (by index: id, type and
    name once, arguments concatenated); checks each call's header comes before its
    arguments."""
    content, calls = "", {}
    for delta in deltas:
        content += delta.get("content", "")
        for piece in delta.get("tool_calls", []):
            if "id" in piece:
                assert piece["index"] not in calls and piece["type"] == "function"
                calls[piece["index"]] = {"id": piece["id"], **piece["function"]}
            else:
                assert set(piece) == {"index", "function"}, piece
                calls[piece["index"]]["arguments"] += piece["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


def stream_deltas(parser: ToolCallParser, text: str, cuts: list[int],
                  max_calls: int | None = None) -> list[list[dict]]:
    """The deltas of ``text`` streamed in pieces ending at ``cuts``, one list per piece."""
    stream = ToolCallStream(parser, max_calls)
    out, at = [], 0
    for cut in [*cuts, len(text)]:
        out.append(stream.feed(text[at:cut], cut == len(text)))
        at = cut
    return out


@pytest.mark.parametrize(("parser", "text"), REPLIES)
@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 1000, "random"])
@pytest.mark.parametrize("max_calls", [None, 1])
def test_streamed_replies_merge_to_the_non_streamed_reply(
        parser: type[ToolCallParser], text: str, chunk: int | str, max_calls: int | None) -> None:
    """The streamed content is the non-streamed content, trimmed the same way, whatever the
    chunks; the calls are the same names and arguments (at most max_calls)."""
    content, calls = parser(TOOLS).parse(text)
    rng = random.Random(len(text))
    cuts = (sorted(rng.sample(range(1, len(text)), min(12, len(text) - 1)))
            if chunk == "random" else list(range(chunk, len(text), chunk)))
    streamed, streamed_calls = merge(sum(stream_deltas(parser(TOOLS), text, cuts, max_calls),
                                         []))
    assert streamed == (content or "")
    assert [(c["name"], c["arguments"]) for c in streamed_calls] == [
        (c.name, c.arguments) for c in calls][:max_calls]
    for call in calls:  # the arguments are JSON objects, written as json.dumps writes them
        assert json.dumps(json.loads(call.arguments), ensure_ascii=False) == call.arguments


def _first_call_arguments(parser: type[ToolCallParser], text: str) -> int:
    calls = parser(TOOLS).parse(text)[1]
    return len(json.loads(calls[0].arguments)) if calls else 0


@pytest.mark.parametrize(("parser", "text"),
                         [r for r in REPLIES if _first_call_arguments(*r) >= 2])
def test_calls_stream_name_first_then_arguments_as_they_come(
        parser: type[ToolCallParser], text: str) -> None:
    """Fed a character at a time, each call's header goes out before the reply ends, and
    its arguments (two or more) in several deltas, most of them before the reply ends."""
    per_char = stream_deltas(parser(TOOLS), text, list(range(1, len(text))))
    before_end = [d for step in per_char[:-1] for d in step]
    _, calls = parser(TOOLS).parse(text)
    headers = [p for d in before_end for p in d.get("tool_calls", []) if "id" in p]
    assert [h["function"]["name"] for h in headers] == [c.name for c in calls]
    assert all(h["function"]["arguments"] == "" for h in headers)
    fragments = [p for d in before_end for p in d.get("tool_calls", []) if "id" not in p]
    early = "".join(p["function"]["arguments"] for p in fragments if p["index"] == 0)
    assert len(fragments) >= 2 and len(early) >= len(calls[0].arguments) // 2, fragments


def test_a_call_name_waits_for_its_end() -> None:
    stream = ToolCallStream(HermesParser())
    assert stream.feed("Sure, <tool", False) == [{"content": "Sure,"}]  # blanks held too
    assert stream.feed('_call>\n{"name": "ad', False) == []
    header, start = stream.feed('d", "arguments": {"a": 1', False)
    assert header["tool_calls"][0]["function"] == {"name": "add", "arguments": ""}
    assert header["tool_calls"][0]["id"].startswith("call_")
    assert start == {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]}
    assert stream.feed("", False) == []  # the number may go on
    (rest,) = stream.feed("}}\n</tool_call>", True)
    assert rest == {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}
    plain = ToolCallStream(HermesParser())
    assert plain.feed("a <t", False) == [{"content": "a"}]
    assert plain.feed("> c", True) == [{"content": " <t> c"}]


def test_text_that_looks_like_a_call_but_is_none_streams_as_content() -> None:
    """Text after a marker that is no call (no name sent yet) goes out as content at once,
    not only when the reply ends."""
    stream = ToolCallStream(XlamParser())
    assert stream.feed("Code:\n``", False) == [{"content": "Code:"}]
    assert stream.feed("`js", False) == []  # ```json would open calls
    assert stream.feed("x\nx = 1", False) == [{"content": "\n```jsx\nx = 1"}]
    assert stream.feed("\n```", True) == [{"content": "\n```"}]


def test_json_values_are_rewritten_exactly_as_json_dumps_writes_them() -> None:
    """Any JSON value, written with any spacing and escapes, in any pieces: the output adds
    up to json.dumps(json.loads(text), ensure_ascii=False)."""
    rng = random.Random(0)

    def value(depth: int = 0) -> object:
        pick = rng.random()
        if depth > 3 or pick < 0.3:
            return rng.choice([0, -1, 2.5, 1e21, True, None, "", 'q"\\\n\té/<\U0001F600',
                               12345678901234567890])
        if pick < 0.65:
            return {f"k{i}ü": value(depth + 1) for i in range(rng.randint(0, 3))}
        return [value(depth + 1) for _ in range(rng.randint(0, 3))]

    for _ in range(500):
        v = value()
        text = json.dumps(v, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 2]))
        stream, out, at = JsonValueStream(), [], 0
        while not stream.done:
            piece = (text + " ")[at : at + rng.randint(1, 6)]
            written, used = stream.feed(piece)
            out.append(written)
            at += used
            assert not stream.failed and at <= len(text) + 1
        assert "".join(out) == json.dumps(json.loads(text), ensure_ascii=False)


def test_streaming_scans_only_the_new_text() -> None:
    """Each chunk costs its own length: the stream never rescans the whole reply."""
    parser = HermesParser()
    seen: list[int] = []
    scan = parser.scan
    marker = len(parser.MARKERS[0])

    def counting(text: str, start: int):  # noqa: ANN202
        seen.append(len(text) - max(0, start - marker + 1))
        return scan(text, start)

    parser.scan = counting  # type: ignore[method-assign]
    stream = ToolCallStream(parser)
    for _ in range(2000):
        stream.feed("word ", False)
    assert max(seen) <= len("word ") + marker
    reader = parser.reader()  # the calls' reader too: a long argument, a character at a time
    reader.feed('<tool_call>{"name": "f", "arguments": {"text": "')
    for _ in range(5000):
        assert reader.feed("x") == [(None, "x")]
    assert len(reader.buffer) <= 1


PLUGIN = '''
from vmkv.server.tool_parsers import MarkedParser, ToolCall, register_parser


@register_parser("shout")
class ShoutParser(MarkedParser):
    MARKERS = ("CALL!",)

    def parse_calls(self, tail):
        name = tail.removeprefix("CALL!").strip()
        return [ToolCall(name, "{}")] if name.isidentifier() else None
'''


def test_a_plugin_registers_a_parser(tmp_path: Path) -> None:
    """--tool-parser-plugin (vLLM's hook): a file that registers parsers; without a reader
    its calls stream whole when the reply ends."""
    plugin = tmp_path / "shout.py"
    plugin.write_text(PLUGIN)
    load_plugin(str(plugin))
    parser = PARSERS.pop("shout")([])
    content, (call,) = parser.parse("Hi. CALL! ping")
    assert (content, call.name, call.arguments) == ("Hi.", "ping", "{}")
    deltas = sum(stream_deltas(parser, "Hi. CALL! ping", [4, 8]), [])
    assert merge(deltas)[0] == "Hi." and merge(deltas)[1][0]["name"] == "ping"
    with pytest.raises(ValueError, match="is not a file"):
        load_plugin(str(tmp_path / "missing.py"))
    (tmp_path / "bad.py").write_text("raise RuntimeError('boom')")
    with pytest.raises(ValueError, match="boom"):
        load_plugin(str(tmp_path / "bad.py"))


# -- the openai client against a real server ----------------------------------------------------
@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Iterator[Running]:
    path = save_qwen_tool_model(tmp_path_factory.mktemp("qwen-stream"))
    yield from serve(EngineConfig(model=str(path), max_model_len=512, max_num_seqs=4))


def test_the_openai_client_sees_argument_deltas_before_the_end(qwen: Running) -> None:
    reply = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
             '\n</tool_call>')
    pattern = "".join("\\" + ch if ch in "\\{}[]().*+?|^$" else ch for ch in reply)
    client = client_of(qwen)
    events = []
    with client.chat.completions.stream(
            model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=TOOLS, max_tokens=80,
            extra_body={"structured_outputs": {"regex": pattern.replace("\n", "\\n")}}) as s:
        for event in s:
            events.append(event)
        final = s.get_final_completion()
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
    assert len(deltas) >= 2, kinds  # fragments, not one whole
    finish = next(i for i, e in enumerate(events) if e.type == "chunk" and e.chunk.choices
                  and e.chunk.choices[0].finish_reason is not None)
    before = [e.arguments_delta for e in events[:finish]
              if e.type == "tool_calls.function.arguments.delta" and e.arguments_delta]
    assert len(before) >= 2, kinds  # arguments before the end, in pieces
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    assert final.choices[0].finish_reason == "tool_calls"
