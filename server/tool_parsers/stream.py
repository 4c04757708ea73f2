"""A streamed reply's tool calls as vLLM streams them (the rules: server/tool_parsers/base.py).

The content is sent as it comes (holding back trailing whitespace and a tail that may become
a marker); from the marker on, the parser's reader turns the text into call pieces: a header
delta (``index``, ``id``, ``type``, ``function.name``, empty ``arguments``), then argument
deltas (``index``, ``function.arguments``). When the reply ends it is parsed whole and the
stream sends what it still owes: the content the reader did not take, the rest of each call's
arguments, the calls it had not begun.
"""

from __future__ import annotations

from typing import Any

from vmkv.server.tool_parsers.base import CallReader, Scan, ToolCall, ToolCallParser


class ToolCallStream:
    """One choice's streamed reply: text deltas in, OpenAI chat deltas out; at most
    ``max_calls`` calls (``parallel_tool_calls: false``: 1). ``calls``: (id, name,
    arguments) of every call sent."""

    def __init__(self, parser: ToolCallParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self.text = ""
        self.sent = 0  # characters of content already sent
        self.scanned = 0
        self.state = Scan(None, 0)
        self.reader: CallReader | None = None
        self.read = 0  # characters the reader has had
        self.content_only = False  # the reader found no call: the reply is content
        self.full = False  # max_calls calls were sent: the rest is not read
        self.calls: list[list[str]] = []

    def feed(self, text: str, finished: bool) -> list[dict[str, Any]]:
        """Deltas for ``text`` (appended to the reply); at the end, what is still owed."""
        self.text += text
        if self.state.call_at is None and not self.state.settled:
            self.state = self.parser.scan(self.text, self.scanned)
            self.scanned = len(self.text)
        deltas: list[dict[str, Any]] = []
        if self.state.call_at is not None and not self.content_only:
            deltas += self._content(_before_blanks(self.text, self.sent, self.state.call_at))
            deltas += self._read()
        if finished:
            return deltas + self._finish()
        if self.content_only or self.state.settled:
            end = len(self.text)
        elif self.state.call_at is None:
            end = self.state.content_end
        else:
            return deltas
        return deltas + self._content(_before_blanks(self.text, self.sent, end))

    def _read(self) -> list[dict[str, Any]]:
        """Call deltas for the text the reader has not had."""
        if self.full:
            return []
        if self.reader is None:
            self.reader = self.parser.reader()
            self.read = self.state.call_at or 0
            if self.reader is None:  # this parser sends calls whole, at the end
                self.full = True
                return []
        pieces = self.reader.feed(self.text[self.read:])
        self.read = len(self.text)
        if self.reader.failed and not self.calls and not pieces:
            self.content_only = True  # what looked like a call is text
            return []
        deltas: list[dict[str, Any]] = []
        for piece in pieces:
            if piece.name is not None:
                if self.max_calls is not None and len(self.calls) >= self.max_calls:
                    self.full = True
                    break
                deltas.append(self._header([self.parser.new_call_id(), piece.name, ""]))
            elif piece.arguments and self.calls:
                self.calls[-1][2] += piece.arguments
                index = len(self.calls) - 1
                last = deltas[-1]["tool_calls"][0] if deltas else None
                if last is not None and last["index"] == index and "id" not in last:
                    last["function"]["arguments"] += piece.arguments
                else:
                    deltas.append({"tool_calls": [{"index": index, "function": {
                        "arguments": piece.arguments}}]})
        return deltas

    def _header(self, call: list[str]) -> dict[str, Any]:
        self.calls.append(call)
        call_id, name, arguments = call
        return {"tool_calls": [{"index": len(self.calls) - 1, "id": call_id, "type": "function",
                                "function": {"name": name, "arguments": arguments}}]}

    def _finish(self) -> list[dict[str, Any]]:
        """What the stream owes once the reply is whole: the parsed reply's content not yet
        sent, the rest of each call begun, the calls not begun."""
        content, calls = (self.parser.parse(self.text) if self.state.call_at is not None
                          else (self.text, []))
        calls = calls[: self.max_calls]
        deltas: list[dict[str, Any]] = []
        if not self.calls:  # nothing was sent as a call: the content is the parsed one's
            deltas += self._content(len(content or ""), content or "")
        for i, call in enumerate(calls):
            if i < len(self.calls):
                deltas += self._rest(i, call)
            else:
                deltas.append(self._header([call.id, call.name, call.arguments]))
        return deltas

    def _rest(self, index: int, call: ToolCall) -> list[dict[str, Any]]:
        """The rest of call ``index``'s arguments, where what was sent begins the parsed
        call's (otherwise the model's text diverged after the header: nothing more)."""
        _, name, sent = self.calls[index]
        if name != call.name or not call.arguments.startswith(sent) or call.arguments == sent:
            return []
        self.calls[index][2] = call.arguments
        return [{"tool_calls": [{"index": index, "function": {
            "arguments": call.arguments[len(sent):]}}]}]

    def _content(self, end: int, text: str | None = None) -> list[dict[str, Any]]:
        """A content delta up to ``end`` of ``text`` (default: the reply)."""
        text = self.text if text is None else text
        if end <= self.sent:
            return []
        delta = {"content": text[self.sent : end]}
        self.sent = end
        return [delta]


def _before_blanks(text: str, start: int, end: int) -> int:
    """``end`` moved back over the whitespace before it, but not before ``start``."""
    while end > start and text[end - 1].isspace():
        end -= 1
    return end
