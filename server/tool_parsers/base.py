"""What every tool-call parser shares: the call, the two shapes of tool syntax, and streaming.

Two shapes of syntax exist. **Marked** replies (hermes, mistral, qwen3_coder, deepseek_v3,
xlam) may start with text; the calls begin at a marker (``<tool_call>``, ``[TOOL_CALLS]``, ...).
**Whole** replies (llama3_json, pythonic, granite) are calls from their first non-blank
character (``{``, ``[``, an opening tag) or not at all.

A reply with calls has as content the text before the calls, trailing whitespace removed (None
when nothing is left); a reply that does not parse is all content, unchanged, never an error.

Streamed (:class:`ToolCallStream`), the content is sent as it comes, holding back only a
trailing run of whitespace and a tail that may still become a marker; from the marker on, the
parser's reader (:meth:`ToolCallParser.reader`) reads the calls as they arrive, as vLLM streams
them: a call's first delta carries its id, type and name, the next ones fragments of its
arguments (re-written as the non-streamed call writes them, so they add up to the same text).
When the reply ends it is parsed whole, and what the stream still owes is sent: so a reply
the parser reads gives exactly the non-streamed content and calls. Text that turns out not to
be a call before a call's name was sent goes out as content; a call whose name was sent stays
sent (the model's later text cannot take it back). Each chunk costs time in its own length.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from vmkv.server.tool_parsers.json_stream import CallPiece


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


class CallReader(Protocol):
    """Reads the calls of a reply from where they begin, as the text arrives."""

    failed: bool  # text that is no call came: nothing after it is read

    def feed(self, text: str) -> list[CallPiece]:
        """The pieces of calls ``text`` completes (a name starts a call)."""

    @property
    def between_calls(self) -> bool:
        """No call is open (what was read so far is whole calls)."""


class Scan(NamedTuple):
    """Where a growing reply stands: ``call_at`` (where the calls begin; None: not seen yet),
    ``content_end`` (how much is surely content), ``settled`` (no call can begin any more)."""

    call_at: int | None
    content_end: int
    settled: bool = False


class ToolCallParser(ABC):
    """Splits a finished reply into content and calls (:class:`~vmkv.server.tool_parsers.
    stream.ToolCallStream` does it as the reply grows).

    Built per request with the request's tools (OpenAI tool definitions; parsers that write
    arguments as text, such as qwen3_coder, read their types from the tools' schemas).
    :attr:`MARKERS` are the strings that open calls: where a tokenizer holds one as a special
    token, the reply is detokenized with special tokens kept (vLLM's ``adjust_request``)."""

    name: str
    MARKERS: tuple[str, ...] = ()

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []

    @abstractmethod
    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content or None, calls); a reply that does not parse is all content."""

    @abstractmethod
    def scan(self, text: str, start: int) -> Scan:
        """Where the calls begin in a growing reply; ``text[:start]`` was scanned before and
        holds no call (so only the new text is searched)."""

    def reader(self) -> CallReader | None:
        """A reader of the calls as they arrive, from where they begin (None: the stream
        sends each call whole when the reply ends)."""
        return None

    def new_call_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def read_calls(self, text: str) -> list[ToolCall] | None:
        """The calls in ``text`` (from where they begin) as :meth:`reader` reads them; None
        unless it is whole calls only, at least one, each with object arguments."""
        reader = self.reader()
        if reader is None:
            return None
        calls: list[list[str]] = []
        for piece in reader.feed(text):
            if piece.name is not None:
                calls.append([piece.name, ""])
            calls[-1][1] += piece.arguments
        if reader.failed or not reader.between_calls or not calls:
            return None
        for _, arguments in calls:
            try:
                if not isinstance(json.loads(arguments), dict):
                    return None
            except json.JSONDecodeError:
                return None
        return [ToolCall(name, arguments, self.new_call_id()) for name, arguments in calls]


class MarkedParser(ToolCallParser):
    """Calls begin at the first of :attr:`MARKERS`; the text before it is content."""

    def parse_calls(self, tail: str) -> list[ToolCall] | None:
        """The calls in ``tail`` (the reply from the first marker on); None if it is not
        only calls (by default: as :meth:`reader` reads them)."""
        return self.read_calls(tail)

    def first_marker(self, text: str, start: int = 0) -> int:
        """Where the first marker at or after ``start`` begins (-1: none)."""
        hits = [at for m in self.MARKERS if (at := text.find(m, start)) >= 0]
        return min(hits, default=-1)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        at = self.first_marker(text)
        calls = self.parse_calls(text[at:]) if at >= 0 else None
        if not calls:
            return text, []
        return text[:at].rstrip() or None, calls

    def scan(self, text: str, start: int) -> Scan:
        longest = max(map(len, self.MARKERS))
        at = self.first_marker(text, max(0, start - longest + 1))
        if at >= 0:
            return Scan(at, at)
        return Scan(None, len(text) - max(_marker_tail(text, m) for m in self.MARKERS))


class WholeParser(ToolCallParser):
    """The whole reply is calls, beginning with one of :attr:`STARTS`, or it is content;
    one of :attr:`WRAPPERS` (opening, closing) may surround the calls."""

    STARTS: tuple[str, ...]
    WRAPPERS: tuple[tuple[str, str], ...] = ()

    def parse_calls(self, body: str) -> list[ToolCall] | None:
        """The calls of ``body`` (the reply stripped, unwrapped); None if it is not calls
        (by default: as :meth:`reader` reads them)."""
        return self.read_calls(body)

    @property
    def MARKERS(self) -> tuple[str, ...]:  # type: ignore[override]  # noqa: N802
        return tuple(opening for opening, _ in self.WRAPPERS)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        for opening, closing in self.WRAPPERS:
            if body.startswith(opening):
                body = body[len(opening):].strip().removesuffix(closing).strip()
                break
        calls = self.parse_calls(body) if body.startswith(self.STARTS) else None
        return (None, calls) if calls else (text, [])

    def scan(self, text: str, start: int) -> Scan:
        head = len(text) - len(text.lstrip())
        rest = text[head:]
        if not rest:
            return Scan(None, 0)
        starts = self.STARTS + self.MARKERS
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
