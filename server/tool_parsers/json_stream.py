"""JSON tool calls read as they arrive, for streaming (server/tool_parsers/base.py).

:class:`JsonValueStream` re-writes one JSON value piece by piece exactly as
``json.dumps(json.loads(value), ensure_ascii=False)`` writes it (the arguments of every
non-streamed call are written so), giving out only text that can no longer change: a number or
literal once it ends, a string's characters as they come (escapes decoded and re-encoded), the
structure at once. So the argument fragments of a streamed call add up to the non-streamed
call's arguments. Each feed costs time in its own length.

:class:`JsonCallsReader` reads calls written as ``{"name": ..., "arguments": {...}}`` objects
between separators (markers, ``[``, ``,``, ``;``): a call's name is given out once it is
complete, then its arguments as fragments.
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

_WHITESPACE = " \t\n\r"
_SCALAR_CHARS = frozenset("0123456789+-.eEtrufalsnNIiy")
_STRING_STOP = re.compile(r'["\x00-\x1f]')
_CLOSES = {"}": ("{", "key_or_close"), "]": ("[", "value_or_close")}


class CallPiece(NamedTuple):
    """A piece of a streamed call: with ``name``, a new call begins (its header); the
    ``arguments`` text adds to the arguments of the call begun last."""

    name: str | None
    arguments: str = ""


class JsonValueStream:
    """One JSON value arriving in pieces, re-written canonically (see the module docstring).

    ``feed(text)`` returns ``(output, consumed)``: the text now final, and how much of ``text``
    belonged to the value (less than all once it ended: the rest is the caller's). ``done``:
    the value is complete; ``failed``: the text is not JSON (nothing more is given out).
    """

    def __init__(self) -> None:
        self.stack: list[str] = []  # the open containers, "{" or "["
        #: value | value_or_close | key | key_or_close | colon | comma_or_close
        self.expect = "value"
        self.string: str | None = None  # the open string's raw text not yet written
        self.in_key = False
        self.scalar = ""  # the open number or literal
        self.done = False
        self.failed = False

    def feed(self, text: str) -> tuple[str, int]:
        out: list[str] = []
        at, n = 0, len(text)
        while at < n and not (self.done or self.failed):
            if self.string is not None:
                at = self._string(text, at, out)
                continue
            ch = text[at]
            if self.scalar:
                if ch in _SCALAR_CHARS:
                    self.scalar += ch
                    at += 1
                else:
                    self._end_scalar(out)  # the character that ended it is read again
                continue
            at += 1
            if ch not in _WHITESPACE:
                self._structure(ch, out)
        return ("", at) if self.failed else ("".join(out), at)

    def _structure(self, ch: str, out: list[str]) -> None:
        expect = self.expect
        if ch in "{[" and expect in ("value", "value_or_close"):
            self.stack.append(ch)
            self.expect = "key_or_close" if ch == "{" else "value_or_close"
            out.append(ch)
        elif (ch in _CLOSES and self.stack[-1:] == [_CLOSES[ch][0]]
              and expect in ("comma_or_close", _CLOSES[ch][1])):
            self.stack.pop()
            out.append(ch)
            self._value_done()
        elif ch == "," and expect == "comma_or_close":
            self.expect = "key" if self.stack[-1] == "{" else "value"
            out.append(", ")
        elif ch == ":" and expect == "colon":
            self.expect = "value"
            out.append(": ")
        elif ch == '"' and expect in ("value", "value_or_close", "key", "key_or_close"):
            self.in_key = expect.startswith("key")
            self.string = ""
            out.append('"')
        elif ch in _SCALAR_CHARS and expect in ("value", "value_or_close"):
            self.scalar = ch
        else:
            self.failed = True

    def _string(self, text: str, at: int, out: list[str]) -> int:
        """Read the open string from ``text[at:]``, write what is final, and return where
        it stopped (after the closing quote, or at the end of ``text``)."""
        while at < len(text):
            stop = _STRING_STOP.search(text, at)
            end = stop.start() if stop else len(text)
            self.string += text[at:end]
            at = end
            if stop is None:
                break
            ch = text[at]
            at += 1
            if ch == '"' and not _escaped(self.string):
                self._write(self.string, out)
                out.append('"')
                self.string = None
                if self.in_key:
                    self.expect = "colon"
                else:
                    self._value_done()
                return at
            if ch < " ":  # a raw control character: not JSON
                self.failed = True
                return at
            self.string += ch  # an escaped quote
        ready = _ready(self.string)
        if ready:
            self._write(self.string[:ready], out)
            self.string = self.string[ready:]
        return at

    def _write(self, raw: str, out: list[str]) -> None:
        """Write a string's raw text (whole escapes only) as json.dumps writes it."""
        if "\\" not in raw:
            out.append(raw)  # nothing to decode (control characters never get here)
            return
        try:
            out.append(json.dumps(json.loads(f'"{raw}"'), ensure_ascii=False)[1:-1])
        except json.JSONDecodeError:
            self.failed = True  # an escape JSON does not have

    def _end_scalar(self, out: list[str]) -> None:
        try:
            value = json.loads(self.scalar)
        except json.JSONDecodeError:
            self.failed = True
            return
        out.append(json.dumps(value))
        self.scalar = ""
        self._value_done()

    def _value_done(self) -> None:
        if self.stack:
            self.expect = "comma_or_close"
        else:
            self.done = True


def _escaped(raw: str) -> bool:
    """Whether a quote after ``raw`` is escaped (``raw`` ends in an odd run of backslashes)."""
    return (len(raw) - len(raw.rstrip("\\"))) % 2 == 1


def _ready(raw: str) -> int:
    """How much of a string's raw text can be written now: all but an escape not yet
    complete, or a high surrogate ``\\uD8xx`` whose low half may still follow."""
    at, n = 0, len(raw)
    while (at := raw.find("\\", at)) >= 0:
        if at + 1 >= n or (raw[at + 1] == "u" and at + 6 > n):
            return at
        if raw[at + 1] != "u":
            at += 2
            continue
        high = raw[at + 2 : at + 4].lower() in ("d8", "d9", "da", "db")
        if high and (at + 6 == n or (raw[at + 6] == "\\" and at + 12 > n)):
            return at
        at += 6
    return n


class _CallObject:
    """One ``{"name": str, <arguments key>: object, ...}`` arriving in pieces: the name once
    complete, then the arguments re-written as they come (an object's; a string holding JSON
    is given out whole once complete; arguments before the name wait for it; none: ``{}``).
    Other keys are read and dropped."""

    def __init__(self, arguments_keys: tuple[str, ...]) -> None:
        self.arguments_keys = arguments_keys
        #: open | key_or_close | key | key_text | colon | value | comma_or_close
        self.expect = "open"
        self.value: JsonValueStream | None = None
        self.key = ""
        self.text = ""  # what the value read has written, unless it is streamed
        self.streaming = False  # the value read is the arguments, given out as they come
        self.named = False  # the header was given out
        self.arguments: str | None = None  # arguments complete (held until the name)
        self.done = False
        self.failed = False

    def feed(self, text: str) -> tuple[list[CallPiece], int]:
        pieces: list[CallPiece] = []
        at = 0
        while at < len(text) and not (self.done or self.failed):
            if self.value is not None:
                out, used = self.value.feed(text[at:])
                at += used
                self._value_text(out, pieces)
                if self.value.failed:
                    self.failed = True
                elif self.value.done:
                    self._value_end(pieces)
                continue
            ch = text[at]
            at += 1
            if ch not in _WHITESPACE:
                self._structure(ch, pieces)
        return pieces, at

    def _structure(self, ch: str, pieces: list[CallPiece]) -> None:
        expect = self.expect
        if ch == "{" and expect == "open":
            self.expect = "key_or_close"
        elif ch == '"' and expect in ("key", "key_or_close"):
            self.expect, self.text = "key_text", ""
            self.value = JsonValueStream()
            self.text, _ = self.value.feed('"')
        elif ch == ":" and expect == "colon":
            self.expect, self.text, self.streaming = "value", "", False
            self.value = JsonValueStream()
        elif ch == "," and expect == "comma_or_close":
            self.expect = "key"
        elif ch == "}" and expect in ("key_or_close", "comma_or_close") and self.named:
            self.done = True
            if self.arguments is None:
                pieces.append(CallPiece(None, "{}"))
        else:
            self.failed = True

    def _is_arguments(self) -> bool:
        return self.key in self.arguments_keys and self.arguments is None

    def _value_text(self, out: str, pieces: list[CallPiece]) -> None:
        if not out:
            return
        if (self.expect == "value" and not self.text and not self.streaming and self.named
                and self._is_arguments() and out.startswith("{")):
            self.streaming = True
        if self.streaming:
            pieces.append(CallPiece(None, out))
        else:
            self.text += out

    def _value_end(self, pieces: list[CallPiece]) -> None:
        text, self.value = self.text, None
        self.text = ""
        if self.expect == "key_text":
            self.key, self.expect = json.loads(text), "colon"
            return
        self.expect = "comma_or_close"
        if self.streaming:
            self.streaming, self.arguments = False, ""
        elif self.key == "name" and not self.named:
            name = json.loads(text)
            if not isinstance(name, str):
                self.failed = True
                return
            self.named = True
            pieces.append(CallPiece(name))
            if self.arguments:
                pieces.append(CallPiece(None, self.arguments))
        elif self._is_arguments():
            self.arguments = _arguments_text(text)
            if self.arguments is None:
                self.failed = True
            elif self.named:
                pieces.append(CallPiece(None, self.arguments))


def _arguments_text(text: str) -> str | None:
    """Arguments read whole: an object, or a string holding an object's JSON, re-written;
    None if they are neither."""
    value: Any = json.loads(text)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


#: :meth:`JsonCallsReader.header`'s answer while the text may still become a header
WAIT = object()


class JsonCallsReader:
    """Calls as JSON objects between ``separators`` (markers, brackets, commas, ...), read as
    they arrive: ``feed(text)`` returns the :class:`CallPiece` s now known. ``failed``: text
    that is neither a separator nor a call came (nothing after it is read);
    ``between_calls``: no call is open. A subclass may read headers written outside JSON
    (:meth:`header`: ``name[ARGS]{...}``, ...), whose arguments follow as a JSON object."""

    def __init__(self, separators: tuple[str, ...],
                 arguments_keys: tuple[str, ...] = ("arguments", "parameters")) -> None:
        self.separators = tuple(sorted(separators, key=len, reverse=True))
        self.arguments_keys = arguments_keys
        self.buffer = ""
        self.call: _CallObject | None = None
        self.bare: JsonValueStream | None = None  # the arguments after a header
        self.failed = False

    @property
    def between_calls(self) -> bool:
        return self.call is None and self.bare is None and not self.failed

    def feed(self, text: str) -> list[CallPiece]:
        self.buffer += text
        pieces: list[CallPiece] = []
        while self.buffer and not self.failed:
            if self.call is not None:
                found, used = self.call.feed(self.buffer)
                pieces += found
                self.buffer = self.buffer[used:]
                self.failed = self.call.failed
                if self.call.done:
                    self.call = None
            elif self.bare is not None:
                out, used = self.bare.feed(self.buffer)
                self.buffer = self.buffer[used:]
                if out:
                    pieces.append(CallPiece(None, out))
                self.failed = self.bare.failed
                if self.bare.done:
                    self.bare = None
            elif not self._between(pieces):
                break
        return pieces

    def _between(self, pieces: list[CallPiece]) -> bool:
        """Read what stands between calls; False when more text is needed (or it failed)."""
        text = self.buffer = self.buffer.lstrip(_WHITESPACE)
        if not text:
            return False
        if any(len(sep) > len(text) and sep.startswith(text) for sep in self.separators):
            return False  # it may still become a (longer) separator
        for sep in self.separators:
            if text.startswith(sep):
                self.buffer = text[len(sep):]
                return True
        if text[0] == "{":
            self.call = _CallObject(self.arguments_keys)
            return True
        header = self.header(text)
        if header is WAIT:
            return False
        if header is None:
            self.failed = True
            return False
        name, used = header  # type: ignore[misc]
        self.buffer = text[used:]
        self.bare = _ObjectValue()
        pieces.append(CallPiece(name))
        return True

    def header(self, text: str) -> tuple[str, int] | object | None:
        """A call's header written outside JSON at the start of ``text``: (name, its
        length), :data:`WAIT` while ``text`` may still become one, or None."""
        return None


class _ObjectValue(JsonValueStream):
    """A JSON value that must be an object (the arguments after a header)."""

    def _structure(self, ch: str, out: list[str]) -> None:
        if not self.stack and ch != "{":
            self.failed = True
            return
        super()._structure(ch, out)
