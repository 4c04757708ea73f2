"""The pythonic tool-call syntax: the whole reply is a Python list of calls with keyword
arguments, ``[get_weather(city="Paris", unit="celsius"), add(a=1, b=2)]`` (Llama 3.2 and 4's
pythonic tool calling, optionally between ``<|python_start|>`` and ``<|python_end|>``).

The list is read with :mod:`ast` (never evaluated): each element must be a call of a plain name
with keyword arguments whose values are literals (strings, numbers, lists, dicts, ``True`` /
``true``, ``None`` / ``null``). Streamed, a call's name goes out at its ``(``, each argument
once its value is complete (``{"city": "Paris"`` then ``, "unit": "celsius"``, then ``}``).
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from vmkv.server.tool_parsers.base import ToolCall, WholeParser
from vmkv.server.tool_parsers.json_stream import CallPiece

_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False,
          "None": None}
_OPENING, _CLOSING = "<|python_start|>", "<|python_end|>"
_IDENTIFIER = re.compile(r"\s*([A-Za-z_]\w*)")


class PythonicParser(WholeParser):
    name = "pythonic"
    STARTS = ("[",)
    WRAPPERS = ((_OPENING, _CLOSING),)

    def parse_calls(self, body: str) -> list[ToolCall] | None:
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError, RecursionError):
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if (not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name)
                    or node.args or any(k.arg is None for k in node.keywords)):
                return None
            try:
                args = {k.arg: _literal(k.value) for k in node.keywords}
            except ValueError:
                return None
            calls.append(ToolCall(node.func.id, json.dumps(args, ensure_ascii=False)))
        return calls

    def reader(self) -> PythonicReader:
        return PythonicReader()


def _literal(node: ast.AST) -> Any:
    """The JSON value of a literal node; ValueError for anything else."""
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict")
        return {str(_literal(k)): _literal(v) for k, v in zip(node.keys, node.values,
                                                               strict=True)}
    value = ast.literal_eval(node)  # constants, negative numbers
    if not isinstance(value, str | int | float | bool | type(None)):
        raise ValueError(f"not a JSON value: {value!r}")
    return value


class PythonicReader:
    """Reads ``[f(a=1), g(b="x")]`` as it arrives (see the module docstring)."""

    def __init__(self) -> None:
        self.buffer = ""
        self.state = "open"  # open | call | argument | value | after_call | closed
        self.value = _ValueScan()
        self.key = ""
        self.arguments = 0  # arguments written for the open call
        self.failed = False

    @property
    def between_calls(self) -> bool:
        return self.state == "closed" and not self.failed

    def feed(self, text: str) -> list[CallPiece]:
        self.buffer += text
        pieces: list[CallPiece] = []
        while not self.failed and self._step(pieces):
            pass
        return pieces

    def _step(self, pieces: list[CallPiece]) -> bool:
        """Read one thing from the buffer; False when more text is needed."""
        if self.state == "value":
            return self._value(pieces)
        text = self.buffer.lstrip()
        if not text:
            return False
        state = self.state
        if state == "open":
            return self._take(text, (_OPENING, "["), {_OPENING: "open", "[": "call"})
        if state in ("call", "argument"):
            return self._name(text, pieces)
        if state == "after_call":
            return self._take(text, (",", "]"), {",": "call", "]": "closed"})
        return self._take(text, (_CLOSING,), {_CLOSING: "closed"})  # closed: the end tag

    def _take(self, text: str, tokens: tuple[str, ...], states: dict[str, str]) -> bool:
        for token in tokens:
            if text.startswith(token):
                self.buffer, self.state = text[len(token):], states[token]
                return True
        self.failed = not any(t.startswith(text) for t in tokens)
        return False

    def _name(self, text: str, pieces: list[CallPiece]) -> bool:
        """A call's name and ``(`` (state call), or an argument's ``key=`` or the ``)``."""
        if self.state == "argument" and text[0] == ")":
            pieces.append(CallPiece(None, "}" if self.arguments else "{}"))
            self.buffer, self.state = text[1:], "after_call"
            return True
        found = _IDENTIFIER.match(text)
        if found is None or found.end() == len(text):
            self.failed = found is None
            return False
        rest = text[found.end():].lstrip()
        if not rest:
            return False
        opener = "(" if self.state == "call" else "="
        if rest[0] != opener or (self.state == "argument" and rest[:2] == "=="):
            self.failed = True
            return False
        if self.state == "call":
            pieces.append(CallPiece(found.group(1)))
            self.arguments, self.state = 0, "argument"
        else:
            self.key, self.state = found.group(1), "value"
            self.value = _ValueScan()
        self.buffer = rest[1:]
        return True

    def _value(self, pieces: list[CallPiece]) -> bool:
        end = self.value.scan(self.buffer)
        if end is None:
            return False
        source, self.buffer = self.buffer[:end], self.buffer[end:].lstrip()
        try:
            value = _literal(ast.parse(source.strip(), mode="eval").body)
        except (SyntaxError, ValueError, RecursionError):
            self.failed = True
            return False
        lead = ", " if self.arguments else "{"
        pieces.append(CallPiece(None, f"{lead}{json.dumps(self.key)}: "
                                      f"{json.dumps(value, ensure_ascii=False)}"))
        self.arguments += 1
        if self.buffer.startswith(","):
            self.buffer = self.buffer[1:]
        self.state = "argument"
        return True


class _ValueScan:
    """Where a Python literal ends in a growing text: the first ``,`` or ``)`` outside
    brackets and strings (scanned once: the position is kept between calls)."""

    def __init__(self) -> None:
        self.at = 0
        self.depth = 0
        self.quote = ""  # the open string's quote (' " ''' or \"\"\")

    def scan(self, text: str) -> int | None:
        at = self.at
        while at < len(text):
            ch = text[at]
            if self.quote:
                if ch == "\\":
                    if at + 1 >= len(text):
                        break
                    at += 2
                    continue
                if text.startswith(self.quote, at):
                    at += len(self.quote)
                    self.quote = ""
                    continue
                if len(self.quote) == 3 and at + 3 > len(text) and ch == self.quote[0]:
                    break  # may be the closing triple quote
                at += 1
            elif ch in "'\"":
                if at + 3 > len(text):
                    break  # a triple quote or not: wait
                self.quote = ch * 3 if text.startswith(ch * 3, at) else ch
                at += len(self.quote)
            elif ch in "([{":
                self.depth += 1
                at += 1
            elif ch in ")]}" and self.depth:
                self.depth -= 1
                at += 1
            elif ch in ",)" and not self.depth:
                self.at = at
                return at
            else:
                at += 1
        self.at = at
        return None
