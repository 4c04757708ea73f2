"""What every tool-call parser shares: the call, the two shapes of tool syntax, and streaming.

Two shapes of syntax exist. **Marked** replies (hermes, mistral) may start with text; the calls
begin at a marker (``<tool_call>``, ``[TOOL_CALLS]``). **Whole** replies (llama3_json, pythonic)
are calls from their first non-blank character (``{``, ``[``) or not at all.

A reply with calls has as content the text before the calls, trailing whitespace removed (None
when nothing is left); a reply that does not parse is all content, unchanged, never an error.
Streamed (:class:`ToolCallStream`), the content is sent as it comes, holding back only a
trailing run of whitespace and a tail that may still become the marker, and the calls follow
when the reply ends, each whole in one delta: merged, the deltas are exactly the non-streamed
reply. Each chunk costs time in its own length only (the marker is searched in the new text).
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, NamedTuple


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def call_from_object(obj: Any, arguments_key: str = "arguments",
                     call_id: str | None = None) -> ToolCall | None:
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
    arguments = json.dumps(args, ensure_ascii=False)
    return ToolCall(obj["name"], arguments) if call_id is None else ToolCall(
        obj["name"], arguments, call_id)


class Scan(NamedTuple):
    """Where a growing reply stands: ``call_at`` (where the calls begin; None: not seen yet),
    ``content_end`` (how much is surely content), ``settled`` (no call can begin any more)."""

    call_at: int | None
    content_end: int
    settled: bool = False


class ToolCallParser(ABC):
    """Splits a finished reply into content and calls; ``stream()`` does it as it grows."""

    name: str

    @abstractmethod
    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content or None, calls); a reply that does not parse is all content."""

    @abstractmethod
    def scan(self, text: str, start: int) -> Scan:
        """Where the calls begin in a growing reply; ``text[:start]`` was scanned before and
        holds no call (so only the new text is searched)."""

    def stream(self, max_calls: int | None = None) -> ToolCallStream:
        return ToolCallStream(self, max_calls)


class MarkedParser(ToolCallParser):
    """Calls begin at :attr:`MARKER`; the text before it is content."""

    MARKER: str

    @abstractmethod
    def parse_calls(self, tail: str) -> list[ToolCall] | None:
        """The calls in ``tail`` (the reply from the first marker on); None if it is not
        only calls."""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        at = text.find(self.MARKER)
        calls = self.parse_calls(text[at:]) if at >= 0 else None
        if not calls:
            return text, []
        return text[:at].rstrip() or None, calls

    def scan(self, text: str, start: int) -> Scan:
        at = text.find(self.MARKER, max(0, start - len(self.MARKER) + 1))
        if at >= 0:
            return Scan(at, at)
        return Scan(None, len(text) - _marker_tail(text, self.MARKER))


class WholeParser(ToolCallParser):
    """The whole reply is calls, beginning with one of :attr:`STARTS`, or it is content;
    :attr:`WRAPPERS` (opening, closing) may surround the calls."""

    STARTS: tuple[str, ...]
    WRAPPERS: tuple[str, str] | None = None

    @abstractmethod
    def parse_calls(self, body: str) -> list[ToolCall] | None:
        """The calls of ``body`` (the reply stripped, unwrapped); None if it is not calls."""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        if self.WRAPPERS is not None:
            opening, closing = self.WRAPPERS
            if body.startswith(opening):
                body = body[len(opening):].strip().removesuffix(closing).strip()
        calls = self.parse_calls(body) if body.startswith(self.STARTS) else None
        return (None, calls) if calls else (text, [])

    def scan(self, text: str, start: int) -> Scan:
        head = len(text) - len(text.lstrip())
        rest = text[head:]
        if not rest:
            return Scan(None, 0)
        starts = self.STARTS + ((self.WRAPPERS[0],) if self.WRAPPERS else ())
        if rest.startswith(starts):
            return Scan(head, head)
        if any(s.startswith(rest) for s in starts):
            return Scan(None, 0)  # it may still become a call: hold it
        return Scan(None, len(text), settled=True)


def _marker_tail(text: str, marker: str) -> int:
    """The length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ToolCallStream:
    """One choice's streamed reply: text deltas in, OpenAI chat deltas out; at most
    ``max_calls`` calls (``parallel_tool_calls: false``: 1)."""

    def __init__(self, parser: ToolCallParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self.text = ""
        self.sent = 0  # characters of content already sent
        self.scanned = 0
        self.state = Scan(None, 0)
        self.calls: list[ToolCall] = []

    def feed(self, text: str, finished: bool) -> list[dict[str, Any]]:
        """Deltas for ``text`` (appended to the reply); at the end, the calls."""
        self.text += text
        if self.state.call_at is None and not self.state.settled:
            self.state = self.parser.scan(self.text, self.scanned)
            self.scanned = len(self.text)
        if finished:
            return self._finish()
        end = (self.state.call_at if self.state.call_at is not None
               else len(self.text) if self.state.settled else self.state.content_end)
        return self._content(_before_blanks(self.text, self.sent, end))

    def _finish(self) -> list[dict[str, Any]]:
        calls: list[ToolCall] = []
        if self.state.call_at is not None:
            calls = self.parser.parse(self.text)[1][: self.max_calls]
        if not calls:
            return self._content(len(self.text))
        deltas = self._content(_before_blanks(self.text, self.sent, self.state.call_at))
        for call in calls:
            deltas.append({"tool_calls": [{"index": len(self.calls), **call.as_dict()}]})
            self.calls.append(call)
        return deltas

    def _content(self, end: int) -> list[dict[str, Any]]:
        if end <= self.sent:
            return []
        delta = {"content": self.text[self.sent : end]}
        self.sent = end
        return [delta]


def _before_blanks(text: str, start: int, end: int) -> int:
    """``end`` moved back over the whitespace before it, but not before ``start``."""
    while end > start and text[end - 1].isspace():
        end -= 1
    return end
