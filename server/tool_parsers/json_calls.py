"""Parsers for the JSON tool-call syntaxes.

    hermes       ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, any number,
                 after optional text (Qwen2, Qwen2.5, Qwen3, Hermes 2/3)
    llama3_json  the whole reply is ``{"name": ..., "parameters": {...}}`` objects separated by
                 ``;`` (Llama 3.1/3.2/3.3's JSON tool calling), optionally after ``<|python_tag|>``
    mistral      ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` (Mistral 7B v0.3,
                 Mixtral, Mistral Nemo), or ``[TOOL_CALLS]name[ARGS]{...}`` per call (newer
                 tokenizers), after optional text; call ids are 9 letters and digits, which
                 Mistral's templates require of the ids sent back to them
    granite      the whole reply is a JSON array of ``{"name", "arguments"}``, optionally after
                 ``<|tool_call|>`` or ``<tool_call>`` (IBM Granite 3.x)
    xlam         a JSON array of ``{"name", "arguments"}``: the whole reply, or after optional
                 text in a code fence (```` ```json ````), after ``[TOOL_CALLS]`` or in
                 ``<tool_call>`` (Salesforce xLAM)
"""

from __future__ import annotations

import json
import re
import secrets
import string

from vmkv.server.tool_parsers.base import (
    MarkedParser,
    Scan,
    ToolCall,
    WholeParser,
    call_from_object,
)
from vmkv.server.tool_parsers.json_stream import WAIT, JsonCallsReader


class HermesParser(MarkedParser):
    name = "hermes"
    MARKERS = ("<tool_call>",)
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse_calls(self, tail: str) -> list[ToolCall] | None:
        calls = []
        for body in self._BLOCK.findall(tail):  # an unclosed last block (EOS first) counts
            try:
                call = call_from_object(json.loads(body))
            except json.JSONDecodeError:
                return None
            if call is None:
                return None
            calls.append(call)
        return calls

    def reader(self) -> JsonCallsReader:
        return JsonCallsReader(("<tool_call>", "</tool_call>"))


class Llama3JsonParser(WholeParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"
    STARTS = ("{",)
    WRAPPERS = ((TAG, ""),)

    def parse_calls(self, body: str) -> list[ToolCall] | None:
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                obj, at = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return None
            call = call_from_object(obj, "parameters")
            if call is None:
                return None
            calls.append(call)
            while at < len(body) and body[at] in "; \n\t\r":
                at += 1
        return calls

    def reader(self) -> JsonCallsReader:
        return JsonCallsReader((self.TAG, ";"), ("parameters", "arguments"))


def mistral_call_id() -> str:
    """A call id as Mistral's templates demand: 9 letters and digits."""
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(9))


class MistralParser(MarkedParser):
    name = "mistral"
    MARKER = "[TOOL_CALLS]"
    MARKERS = (MARKER,)
    _NAMED = re.compile(r"\s*([\w.\-]+)(?:\[CALL_ID\][A-Za-z0-9]+)?\[ARGS\]", re.DOTALL)

    def parse_calls(self, tail: str) -> list[ToolCall] | None:
        calls: list[ToolCall] = []
        decoder = json.JSONDecoder()
        for part in tail.split(self.MARKER)[1:]:
            named = self._NAMED.match(part)
            try:
                if named is not None:  # name[ARGS]{...}
                    args, end = decoder.raw_decode(part, named.end())
                    objects = [{"name": named.group(1), "arguments": args}]
                else:  # [{...}, ...] or {...}
                    start = len(part) - len(part.lstrip())
                    value, end = decoder.raw_decode(part, start)
                    objects = value if isinstance(value, list) else [value]
            except json.JSONDecodeError:
                return None
            if part[end:].strip() or not objects:
                return None
            for obj in objects:
                call = call_from_object(obj, call_id=mistral_call_id())
                if call is None:
                    return None
                calls.append(call)
        return calls

    def new_call_id(self) -> str:
        return mistral_call_id()

    def reader(self) -> JsonCallsReader:
        return _MistralReader((self.MARKER, "[", ",", "]"))


class _MistralReader(JsonCallsReader):
    """Mistral's calls: JSON objects, or ``name[ARGS]{...}`` (``name[CALL_ID]id[ARGS]``)."""

    _PARTIAL = re.compile(r"[\w.\-]+(?:\[[A-Z_]*\]?[A-Za-z0-9]*)*")

    def header(self, text: str) -> tuple[str, int] | object | None:
        named = MistralParser._NAMED.match(text)
        if named is not None:
            return named.group(1), named.end()
        return WAIT if self._PARTIAL.fullmatch(text) and len(text) < 256 else None


class GraniteParser(WholeParser):
    name = "granite"
    STARTS = ("[",)
    WRAPPERS = (("<|tool_call|>", ""), ("<tool_call>", ""))

    def reader(self) -> JsonCallsReader:
        return JsonCallsReader(("<|tool_call|>", "<tool_call>", "[", ",", "]"))


class XlamParser(MarkedParser):
    """xLAM's calls begin at a marker, or at a ``[`` that opens the reply."""

    name = "xlam"
    MARKERS = ("```", "[TOOL_CALLS]", "<tool_call>")

    def first_marker(self, text: str, start: int = 0) -> int:
        head = len(text) - len(text.lstrip())
        if start <= head and text[head:head + 1] == "[":
            return head
        return super().first_marker(text, start)

    def scan(self, text: str, start: int) -> Scan:
        if not text.strip():
            return Scan(None, 0)
        return super().scan(text, start)

    def reader(self) -> JsonCallsReader:
        return JsonCallsReader(("```json", "```", "[TOOL_CALLS]", "<tool_call>", "</tool_call>",
                                "[", ",", "]"))
