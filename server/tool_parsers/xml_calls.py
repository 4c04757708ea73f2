"""The XML tool-call syntax of Qwen3-Coder (``qwen3_coder``), after optional text::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A parameter's value is text (one newline after its tag and one before ``</parameter>`` are
not part of it), converted as vLLM converts it, by the type the tool's schema gives the
parameter: strings stay text; ``integer`` / ``number`` / ``boolean`` are read as such; objects
and arrays as JSON (or a Python literal); ``null`` / ``None`` as null where the type allows
it; a parameter the schema does not name, or a value that does not read, stays text.
Streamed, the name goes out at its ``>``, each parameter once its ``</parameter>`` came.
"""

from __future__ import annotations

import ast
import contextlib
import json
from typing import Any

from vmkv.server.tool_parsers.base import MarkedParser
from vmkv.server.tool_parsers.json_stream import CallPiece

CALL, CALL_END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_STRINGS = ("string", "str", "text", "varchar", "char", "enum")


class Qwen3CoderParser(MarkedParser):
    name = "qwen3_coder"
    MARKERS = (CALL,)

    def reader(self) -> XmlCallsReader:
        return XmlCallsReader(self.tools)


class XmlCallsReader:
    """Reads Qwen3-Coder's calls as they arrive (see the module docstring)."""

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        self.schemas = {t["function"]["name"]: t["function"].get("parameters") or {}
                        for t in tools if isinstance(t.get("function"), dict)
                        and isinstance(t["function"].get("name"), str)}
        self.buffer = ""
        self.state = "between"  # between | call | function | parameter
        self.function = ""
        self.parameter = ""
        self.written = 0  # parameters written for the open function
        self.failed = False

    @property
    def between_calls(self) -> bool:
        return self.state == "between" and not self.failed

    def feed(self, text: str) -> list[CallPiece]:
        self.buffer += text
        pieces: list[CallPiece] = []
        while not self.failed and self._step(pieces):
            pass
        return pieces

    def _step(self, pieces: list[CallPiece]) -> bool:
        if self.state == "parameter":
            return self._value(pieces)
        text = self.buffer = self.buffer.lstrip()
        if not text:
            return False
        if self.state == "between":
            return self._tag(text, CALL, "call") or self._tag(text, CALL_END, "between")
        if self.state == "call":
            if self._tag(text, CALL_END, "between"):
                return True
            name = self._named(text, FUNCTION)
            if name is not None:
                self.function, self.written, self.state = name, 0, "function"
                pieces.append(CallPiece(name))
            return name is not None
        if self._tag(text, FUNCTION_END, "call"):
            pieces.append(CallPiece(None, "}" if self.written else "{}"))
            return True
        name = self._named(text, PARAMETER)
        if name is not None:
            self.parameter, self.state = name, "parameter"
        return name is not None

    def _tag(self, text: str, tag: str, state: str) -> bool:
        if text.startswith(tag):
            self.buffer, self.state = text[len(tag):], state
            return True
        return False

    def _named(self, text: str, opening: str) -> str | None:
        """The name of ``<function=NAME>`` / ``<parameter=NAME>`` at the start of ``text``
        (consumed); None while it is incomplete, or, failing, when it is something else."""
        if not text.startswith(opening):
            self.failed = not any(t.startswith(text[:len(t)]) for t in (
                opening, CALL_END, FUNCTION_END))
            return None
        end = text.find(">", len(opening))
        if end < 0:
            self.failed = "\n" in text or len(text) > 512
            return None
        self.buffer = text[end + 1:]
        return text[len(opening):end].strip()

    def _value(self, pieces: list[CallPiece]) -> bool:
        ends = [at for tag in (PARAMETER_END, FUNCTION_END) if (at := self.buffer.find(tag)) >= 0]
        if not ends:
            return False
        at = min(ends)
        raw = self.buffer[:at]
        closed = self.buffer.startswith(PARAMETER_END, at)
        self.buffer = self.buffer[at + (len(PARAMETER_END) if closed else 0):]
        raw = raw.removeprefix("\n").removesuffix("\n")
        value = convert(raw, self.schemas.get(self.function, {}), self.parameter)
        lead = ", " if self.written else "{"
        pieces.append(CallPiece(None, f"{lead}{json.dumps(self.parameter, ensure_ascii=False)}"
                                      f": {json.dumps(value, ensure_ascii=False)}"))
        self.written += 1
        self.state = "function"
        return True


def convert(raw: str, schema: dict[str, Any], name: str) -> Any:
    """A parameter's text as the value its type in ``schema`` (the function's parameters)
    says (see the module docstring)."""
    spec = (schema.get("properties") or {}).get(name)
    if not isinstance(spec, dict):
        return raw
    kind, nullable = _type_of(spec)
    if nullable and raw.lower() in ("null", "none"):
        return None
    if kind in _STRINGS:
        return raw
    if raw.lower() in ("null", "none"):
        return None
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        with contextlib.suppress(ValueError):
            return int(raw)
        return raw
    if kind.startswith(("num", "float")):
        with contextlib.suppress(ValueError, OverflowError):
            number = float(raw)
            return int(number) if number.is_integer() else number
        return raw
    if kind in ("boolean", "bool", "binary"):
        return raw.lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        with contextlib.suppress(json.JSONDecodeError):
            return json.loads(raw)
    with contextlib.suppress(ValueError, SyntaxError, TypeError, RecursionError):
        value = ast.literal_eval(raw)
        json.dumps(value)  # only what JSON can hold
        return value
    return raw


def _type_of(spec: dict[str, Any]) -> tuple[str, bool]:
    """(the parameter's type, whether null is allowed) from its schema."""
    kind = spec.get("type")
    if isinstance(kind, list):
        others = [k for k in kind if k != "null"]
        return (str(others[0]).lower() if others else "null"), "null" in kind
    if kind is not None:
        return str(kind).lower(), str(kind).lower() == "null"
    options = [o for o in spec.get("anyOf") or [] if isinstance(o, dict) and "type" in o]
    nullable = any(o["type"] == "null" for o in options)
    others = [str(o["type"]).lower() for o in options if o["type"] != "null"]
    return (others[0] if others else "string"), nullable
