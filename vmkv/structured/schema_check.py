"""Which JSON schemas structured outputs accept: only what xgrammar enforces.

xgrammar 0.2.9 compiles many schemas whose keywords it then does not enforce: the output is
valid JSON that fails the schema. Each rule below refuses one such case with a ValueError that
names the keyword and where it is (each was found by sampling under the compiled grammar and
validating with ``jsonschema``; ``tests/test_structured_keywords.py`` checks every refusal and
that every accepted keyword holds in every sample):

- keywords never enforced (:data:`UNENFORCED_KEYWORDS`; ``uniqueItems`` only when true);
- ``allOf`` with more than one branch (only the first is applied), and any validation keyword
  beside ``allOf`` or ``$ref`` (it is ignored);
- ``oneOf`` whose branches may overlap (it is read as ``anyOf``): accepted only when every two
  branches are provably disjoint: by type, by their ``const``/``enum`` values, or by a
  required property whose ``const``/``enum`` values differ (a discriminator, as pydantic's
  tagged unions have);
- number keywords (``minimum`` ...) and string keywords (``maxLength``, ``pattern``, ``format``)
  in a schema whose ``type`` does not name their type (without it they are ignored);
- ``multipleOf`` except on ``"type": "integer"`` with a whole divisor (numbers are not
  checked);
- ``required`` naming a property that ``properties`` does not declare (ignored: ``{}`` passes);
- ``enum`` / ``const`` values outside the schema's ``type`` (the type is ignored);
- a ``format`` other than :data:`ENFORCED_FORMATS` (``date`` and ``date-time`` take 31 days in
  every month, ``ipv4`` leading zeros, ``hostname`` labels over 63 characters; others are not
  checked at all).

Keywords that do not validate (``title``, ``description``, ``default``, ``examples``, ...) and
keywords JSON Schema does not know are ignored, as every validator ignores them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from itertools import combinations
from typing import Any

#: keywords xgrammar 0.2 accepts but does not enforce
UNENFORCED_KEYWORDS = ("contains", "minContains", "maxContains", "not", "if", "then", "else",
                       "dependentSchemas", "dependentRequired", "dependencies",
                       "unevaluatedProperties", "unevaluatedItems", "uniqueItems",
                       "additionalItems", "$dynamicRef", "$recursiveRef")

#: string formats whose every generated value is valid
ENFORCED_FORMATS = ("uuid", "ipv6", "duration")

#: keywords that do not constrain the value (allowed beside ``$ref`` and ``allOf``)
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id",
                         "$comment", "$anchor", "$dynamicAnchor", "deprecated", "readOnly",
                         "writeOnly", "discriminator", "$defs", "definitions"})

NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
STRING_KEYWORDS = ("minLength", "maxLength", "pattern", "format")
_VALIDATION = frozenset({"type", "enum", "const", *NUMBER_KEYWORDS, *STRING_KEYWORDS,
                         "items", "prefixItems", "minItems", "maxItems", "properties",
                         "required", "additionalProperties", "patternProperties",
                         "propertyNames", "minProperties", "maxProperties", "anyOf",
                         "oneOf", "allOf", "$ref", *UNENFORCED_KEYWORDS})

_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SINGLE = ("items", "additionalProperties", "propertyNames", "contains", "not", "if", "then",
           "else", "unevaluatedProperties", "unevaluatedItems", "additionalItems")


class SchemaRefused(ValueError):
    """A schema keyword structured outputs would not enforce."""

    def __init__(self, keyword: str, path: str, why: str) -> None:
        super().__init__(f"invalid structured_outputs.json: the JSON-schema keyword "
                         f"{keyword!r} (at {path}) is not supported: {why}")
        self.keyword = keyword


def check_schema_supported(schema: Any) -> None:
    """Raise :class:`SchemaRefused` (a ValueError) for the first rule of this module's
    docstring that ``schema`` breaks; return None if xgrammar enforces all of it."""
    for path, sub in _subschemas(schema, "#"):
        _check_one(sub, path, schema, {"string"} if path.endswith("/propertyNames") else None)


def _subschemas(schema: Any, path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(path, subschema) of ``schema`` and every schema nested in it (by applicator keyword:
    the values of ``default`` or ``const`` are not schemas)."""
    if not isinstance(schema, dict):
        return
    yield path, schema
    for key in _MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                yield from _subschemas(sub, f"{path}/{key}/{name}")
    for key in _LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                yield from _subschemas(sub, f"{path}/{key}/{i}")
    for key in _SINGLE:
        value = schema.get(key)
        if isinstance(value, list):  # items as a list (draft 4): xgrammar refuses it itself
            for i, sub in enumerate(value):
                yield from _subschemas(sub, f"{path}/{key}/{i}")
        else:
            yield from _subschemas(value, f"{path}/{key}")


def _check_one(schema: dict[str, Any], path: str, root: Any, implied: set[str] | None) -> None:
    """The rules for one subschema; ``implied``: its values' types when its place fixes them
    (a property name is a string)."""
    for keyword in UNENFORCED_KEYWORDS:
        if keyword in schema and not (keyword == "uniqueItems" and schema[keyword] is False):
            raise SchemaRefused(keyword, path, "xgrammar does not enforce it")
    for holder in ("$ref", "allOf"):
        if holder in schema:
            beside = sorted(k for k in schema if k in _VALIDATION and k != holder)
            if beside:
                raise SchemaRefused(beside[0], path, f"a validation keyword beside {holder!r} "
                                    "is ignored; move it into the referenced schema")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        raise SchemaRefused("allOf", path, "only its first branch would be enforced; merge the "
                            "branches into one schema")
    if isinstance(schema.get("oneOf"), list):
        _check_one_of(schema["oneOf"], path, root)
    types = _types(schema) or implied
    _check_typed_keywords(schema, path, types)
    _check_values(schema, path, types)
    required, properties = schema.get("required"), schema.get("properties") or {}
    if isinstance(required, list) and isinstance(properties, dict):
        missing = [name for name in required if name not in properties]
        if missing:
            raise SchemaRefused("required", path, f"{missing[0]!r} is not in 'properties' (an "
                                "undeclared required property is not enforced)")


def _types(schema: dict[str, Any]) -> set[str] | None:
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list) and all(isinstance(k, str) for k in kind):
        return set(kind)
    return None


def _check_typed_keywords(schema: dict[str, Any], path: str, types: set[str] | None) -> None:
    for keywords, needs in ((NUMBER_KEYWORDS, {"integer", "number"}),
                            (STRING_KEYWORDS, {"string"})):
        for keyword in keywords:
            if keyword in schema and not (types and types & needs):
                wanted = " or ".join(sorted(needs))
                raise SchemaRefused(keyword, path, f"it needs a 'type' of {wanted} beside it "
                                    "(without one it is ignored)")
    if "multipleOf" in schema:
        divisor = schema["multipleOf"]
        if types != {"integer"} or not _is_whole(divisor) or divisor <= 0:
            raise SchemaRefused("multipleOf", path, "only a whole divisor of a schema of "
                                "'type': 'integer' is enforced")
    fmt = schema.get("format")
    if fmt is not None and fmt not in ENFORCED_FORMATS:
        raise SchemaRefused("format", path, f"format {fmt!r} is not enforced (these are: "
                            f"{', '.join(ENFORCED_FORMATS)}); use a 'pattern'")


def _check_values(schema: dict[str, Any], path: str, types: set[str] | None) -> None:
    if types is None:
        return
    for keyword in ("enum", "const"):
        if keyword not in schema:
            continue
        values = schema[keyword] if keyword == "enum" else [schema[keyword]]
        for value in values if isinstance(values, list) else []:
            if not _value_types(value) & types:
                raise SchemaRefused(keyword, path, f"the value {json.dumps(value)[:40]} is not "
                                    f"of the schema's type {sorted(types)}")


def _is_whole(value: Any) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, float) and value.is_integer())


def _value_types(value: Any) -> set[str]:
    """The JSON-schema types ``value`` is an instance of."""
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if _is_whole(value):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number"}
    if isinstance(value, str):
        return {"string"}
    return {"array"} if isinstance(value, list) else {"object"}


# -- oneOf --------------------------------------------------------------------------------------
def _check_one_of(branches: list[Any], path: str, root: Any) -> None:
    resolved = [_resolve(b, root) for b in branches]
    for (i, a), (j, b) in combinations(enumerate(resolved), 2):
        if not _disjoint(a, b):
            raise SchemaRefused("oneOf", path, f"branches {i} and {j} may both match a value "
                                "(xgrammar reads oneOf as anyOf); make them disjoint by type, "
                                "by const/enum, or by a required property with a different "
                                "const in each, or use anyOf")


def _resolve(schema: Any, root: Any, depth: int = 0) -> Any:
    """``schema`` with a local ``$ref`` (``#/...``) followed, if it is one."""
    ref = schema.get("$ref") if isinstance(schema, dict) else None
    if not isinstance(ref, str) or not ref.startswith("#") or depth > 32:
        return schema
    target = root
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(target, dict) or part not in target:
            return schema
        target = target[part]
    return _resolve(target, root, depth + 1)


def _disjoint(a: Any, b: Any) -> bool:
    """True when no JSON value can validate against both schemas (by a check that may say
    False for schemas that are in fact disjoint, never True for overlapping ones)."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    ta, tb = _possible_types(a), _possible_types(b)
    if ta is not None and tb is not None and not ta & tb:
        return True
    va, vb = _values(a), _values(b)
    if va is not None and vb is not None and not va & vb:
        return True
    if ta == tb == {"object"}:
        for name in set(_required(a)) & set(_required(b)):
            pa = _values(_property(a, name))
            pb = _values(_property(b, name))
            if pa is not None and pb is not None and not pa & pb:
                return True
    return False


def _possible_types(schema: dict[str, Any]) -> set[str] | None:
    types = _types(schema)
    if types is not None:
        return types | ({"number"} if "integer" in types else set()) | (
            {"integer"} if "number" in types else set())
    values = schema.get("enum") if isinstance(schema.get("enum"), list) else (
        [schema["const"]] if "const" in schema else None)
    if values is None:
        return None
    return set().union(*(_value_types(v) for v in values)) if values else set()


def _values(schema: Any) -> set[str] | None:
    """The JSON texts of the only values ``schema`` allows, or None if not a finite set."""
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        values = [schema["const"]]
    elif isinstance(schema.get("enum"), list):
        values = schema["enum"]
    else:
        return None
    return {json.dumps(int(v) if isinstance(v, float) and v.is_integer() else v,
                       sort_keys=True) for v in values}


def _required(schema: dict[str, Any]) -> list[str]:
    required = schema.get("required")
    return [r for r in required if isinstance(r, str)] if isinstance(required, list) else []


def _property(schema: dict[str, Any], name: str) -> Any:
    properties = schema.get("properties")
    return properties.get(name) if isinstance(properties, dict) else None
