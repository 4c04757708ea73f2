"""The pythonic tool-call syntax: the whole reply is a Python list of calls with keyword
arguments, ``[get_weather(city="Paris", unit="celsius"), add(a=1, b=2)]`` (Llama 3.2 and 4's
pythonic tool calling, optionally between ``<|python_start|>`` and ``<|python_end|>``).

The list is read with :mod:`ast` (never evaluated): each element must be a call of a plain name
with keyword arguments whose values are literals (strings, numbers, lists, dicts, ``True`` /
``true``, ``None`` / ``null``).
"""

from __future__ import annotations

import ast
import json
from typing import Any

from vmkv.server.tool_parsers.base import ToolCall, WholeParser

_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False,
          "None": None}


class PythonicParser(WholeParser):
    name = "pythonic"
    STARTS = ("[",)
    WRAPPERS = ("<|python_start|>", "<|python_end|>")

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
