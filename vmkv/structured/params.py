"""What a request constrains its output to, with vLLM's names (``StructuredOutputsParams``).

Exactly one of ``json``, ``regex``, ``choice``, ``grammar`` or ``json_object`` is set. The value
is normalised at construction (a pydantic model class or a dict schema becomes its JSON text), so
the object is hashable and equal params compile to the same cached grammar. Nothing here needs
xgrammar: the engine compiles (and rejects what xgrammar cannot honour) in ``compiler.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One output constraint.

    Attributes:
        json: a JSON schema (dict, JSON text, or a pydantic model class); the output is a JSON
            document that validates against it.
        regex: the output matches this regular expression (whole output).
        choice: the output is exactly one of these strings.
        grammar: an EBNF (GBNF) grammar whose ``root`` rule the output matches.
        json_object: the output is any JSON object (OpenAI's ``json_object`` mode).
        disable_any_whitespace: JSON without free whitespace (``", "`` and ``": "`` separators
            only); by default any whitespace is allowed between tokens, as in vLLM.
    """

    json: str | dict | Any | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError("structured outputs need exactly one of json, regex, choice, grammar"
                             f" or json_object; got {set_kinds or 'none'}")
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            object.__setattr__(self, "choice", _choices(self.choice))
        for name in ("json_object", "disable_any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be a bool")

    @property
    def kind(self) -> str:
        """Which constraint is set: one of :data:`KINDS`."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StructuredOutputsParams:
        """From a request body's ``structured_outputs`` object; ValueError for unknown keys."""
        if not isinstance(data, dict):
            raise ValueError(f"structured_outputs must be an object, got {data!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unsupported structured_outputs fields: {', '.join(unknown)}")
        return cls(**data)


def _schema_text(schema: Any) -> str:
    """A JSON schema as JSON text (property order kept: it is the order of generation)."""
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
    if not isinstance(schema, dict | bool):
        raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
    return json.dumps(schema, ensure_ascii=False)


def _choices(choice: Iterable[str]) -> tuple[str, ...]:
    if isinstance(choice, str) or not isinstance(choice, Iterable):
        raise ValueError(f"structured_outputs.choice must be a list of strings, got {choice!r}")
    choices = tuple(choice)
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
    return choices
