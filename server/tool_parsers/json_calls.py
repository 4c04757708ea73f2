"""Parsers for the JSON tool-call syntaxes.

    hermes       ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, any number,
                 after optional text (Qwen2, Qwen2.5, Qwen3, Hermes 2/3)
    llama3_json  the whole reply is ``{"name": ..., "parameters": {...}}`` objects separated by
                 ``;`` (Llama 3.1/3.2/3.3's JSON tool calling), optionally after ``<|python_tag|>``
    mistral      ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` (Mistral 7B v0.3,
                 Mixtral, Mistral Nemo), or ``[TOOL_CALLS]name[ARGS]{...}`` per call (newer
                 tokenizers), after optional text; call ids are 9 letters and digits, which
                 Mistral's templates require of the ids sent back to them
"""

from __future__ import annotations

import json
import re
import secrets
import string

from vmkv.server.tool_parsers.base import MarkedParser, ToolCall, WholeParser, call_from_object


class HermesParser(MarkedParser):
    name = "hermes"
    MARKER = "<tool_call>"
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


class Llama3JsonParser(WholeParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"
    STARTS = ("{",)
    WRAPPERS = (TAG, "")

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


def mistral_call_id() -> str:
    """A call id as Mistral's templates demand: 9 letters and digits."""
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(9))


class MistralParser(MarkedParser):
    name = "mistral"
    MARKER = "[TOOL_CALLS]"
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
