"""Read tool calls out of a model's text, as the chat templates of the supported families make
the model write them (``tool_choice: "auto"``).

    hermes       ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, any number,
                 after optional text (Qwen2, Qwen2.5, Qwen3, Hermes 2/3)
    llama3_json  the whole reply is ``{"name": ..., "parameters": {...}}`` objects separated by
                 ``;`` (Llama 3.1/3.2/3.3's JSON tool calling), optionally after ``<|python_tag|>``

A reply that does not parse is plain content, never an error. Each parser also streams: text is
shown as it comes until the tool-call syntax starts (a tail that might be its beginning is held
back), and the calls are emitted, each whole in one delta, when the reply ends.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def call_from_object(obj: Any, arguments_key: str = "arguments") -> ToolCall | None:
    """A call from ``{"name": str, <arguments_key>: object}``; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolCallParser(ABC):
    """Splits a finished reply into content and calls; ``stream()`` does it incrementally."""

    name: str

    @abstractmethod
    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content or None, calls); a reply that does not parse is all content."""

    @abstractmethod
    def content_end(self, text: str) -> int:
        """How much of a growing reply is surely content: up to where tool syntax (or what
        might still become it) begins."""

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


class HermesParser(ToolCallParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        at = text.find(self.OPEN)
        if at < 0:
            return text, []
        calls = []
        for body in self._BLOCK.findall(text[at:]):
            try:
                call = call_from_object(json.loads(body))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        content = text[:at].strip()
        return content or None, calls

    def content_end(self, text: str) -> int:
        return _content_end(text, self.OPEN)


class Llama3JsonParser(ToolCallParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        body = body.removeprefix(self.TAG).strip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                obj, at = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return text, []
            call = call_from_object(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            while at < len(body) and body[at] in "; \n\t\r":
                at += 1
        return None, calls

    def content_end(self, text: str) -> int:
        head = text.lstrip()
        if not head:
            return 0
        if head.startswith("{") or head.startswith(self.TAG) or self.TAG.startswith(head):
            return 0  # a tool call (or its beginning): hold everything
        return len(text)


PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser,
                                            "llama3_json": Llama3JsonParser}


def parser_for_template(chat_template: str | None) -> ToolCallParser | None:
    """The parser whose syntax the chat template teaches, or None if it teaches neither."""
    template = chat_template or ""
    if HermesParser.OPEN in template:
        return HermesParser()
    if Llama3JsonParser.TAG in template or "ipython" in template:
        return Llama3JsonParser()
    return None


class ToolCallStream:
    """One choice's streamed reply: text deltas in, OpenAI chat deltas out."""

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of content already sent
        self.calls: list[ToolCall] = []

    def feed(self, text: str, finished: bool) -> list[dict[str, Any]]:
        """Deltas for ``text`` (appended to the reply); at the end, the calls not yet sent."""
        self.text += text
        deltas: list[dict[str, Any]] = []
        calls = self.parser.parse(self.text)[1] if finished else []
        end = len(self.text) if finished and not calls else self.parser.content_end(self.text)
        if end > self.sent:
            deltas.append({"content": self.text[self.sent : end]})
            self.sent = end
        for call in calls:
            index = len(self.calls)
            self.calls.append(call)
            deltas.append({"tool_calls": [{"index": index, **call.as_dict()}]})
        return deltas


def _content_end(text: str, marker: str) -> int:
    """Where ``marker`` starts in ``text``, or the length less any tail that is a prefix of
    it (it may still become the marker)."""
    at = text.find(marker)
    if at >= 0:
        return at
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return len(text) - k
    return len(text)
