"""Structured outputs enforce every JSON-schema keyword they accept: each keyword xgrammar would
let through unenforced is refused (and shown to go unenforced), and each accepted keyword holds
in every output of a random walk under the compiled grammar (vmkv/structured/schema_check.py)."""

from __future__ import annotations

import datetime
import ipaddress
import json
import re
import uuid

import jsonschema
import numpy as np
import pytest
import xgrammar as xgr
from grammar_walk import GrammarWalker

from vmkv.models import load_tokenizer, resolve_model
from vmkv.structured import StructuredOutputsParams as S
from vmkv.structured.compiler import GrammarCompilerCache
from vmkv.structured.schema_check import SchemaRefused, check_schema_supported

VOCAB, EOS = 49152, 2
INT = {"type": "integer", "minimum": 0, "maximum": 9}
OBJ_AB = {"type": "object", "properties": {"a": {"enum": [1]}, "b": {"enum": [2]}}}

#: (name, schema, the keyword named, a complete document xgrammar accepts that violates it)
REFUSED = [
    ("uniqueItems", {"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True},
     "uniqueItems", "[1,1]"),
    ("dependentRequired", {**OBJ_AB, "dependentRequired": {"a": ["b"]}},
     "dependentRequired", '{"a":1}'),
    ("dependentSchemas", {**OBJ_AB, "dependentSchemas": {"a": {"required": ["b"]}}},
     "dependentSchemas", '{"a":1}'),
    ("allOf, two branches", {"allOf": [INT, {"maximum": 5}]}, "allOf", "9"),
    ("oneOf, overlapping", {"oneOf": [INT, {"type": "integer", "minimum": 3, "maximum": 12}]},
     "oneOf", "5"),
    ("oneOf, same discriminator", {"oneOf": [
        {"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
        {"type": "object", "properties": {"k": {"enum": ["a", "b"]}}, "required": ["k"]}]},
     "oneOf", '{"k":"a"}'),
    ("contains", {"type": "array", "items": {"enum": [1, 2]}, "contains": {"const": 2}},
     "contains", "[1]"),
    ("not", {**INT, "not": {"const": 1}}, "not", "1"),
    ("if/then", {**INT, "if": {"minimum": 5}, "then": {"maximum": 6}}, "if", "9"),
    ("a keyword beside $ref", {"$defs": {"d": INT}, "$ref": "#/$defs/d", "maximum": 3},
     "maximum", "9"),
    ("a keyword beside allOf", {"allOf": [INT], "maximum": 3}, "maximum", "9"),
    ("minimum without a type", {"minimum": 5, "maximum": 7}, "minimum", "9"),
    ("maxLength without a type", {"maxLength": 2}, "maxLength", '"abcdef"'),
    ("pattern without a type", {"pattern": "^a$"}, "pattern", '"b"'),
    ("multipleOf on numbers", {"type": "number", "multipleOf": 0.5}, "multipleOf", "0.7"),
    ("required, undeclared", {"type": "object", "properties": {"a": {"enum": [1]}},
                              "additionalProperties": {"enum": [2]}, "required": ["a", "zz"]},
     "required", '{"a":1}'),
    ("enum outside the type", {"type": "string", "enum": ["a", 1]}, "enum", "1"),
    ("format date", {"type": "string", "format": "date"}, "format", '"2024-09-31"'),
    ("format date-time", {"type": "string", "format": "date-time"}, "format", None),
    ("format ipv4", {"type": "string", "format": "ipv4"}, "format", '"1.2.3.004"'),
    ("format regex", {"type": "string", "format": "regex"}, "format", '"("'),
    ("format unknown", {"type": "string", "format": "colour"}, "format", None),
    ("unevaluatedProperties", {**OBJ_AB, "unevaluatedProperties": {"enum": [3]}},
     "unevaluatedProperties", None),
    ("nested deep", {"type": "object", "properties": {"x": {"type": "array", "items": {
        "type": "object", "properties": {"y": {"type": "array", "items": {"enum": [1, 2]},
                                               "uniqueItems": True}}}}}},
     "uniqueItems", None),
]


@pytest.fixture(scope="module")
def tokenizer(default_model: object) -> object:
    return load_tokenizer(resolve_model(None, progress=False))


@pytest.fixture(scope="module")
def grammars(tokenizer: object) -> GrammarCompilerCache:
    return GrammarCompilerCache(tokenizer, VOCAB, (EOS,))


@pytest.fixture(scope="module")
def walker(tokenizer: object) -> GrammarWalker:
    return GrammarWalker(tokenizer, VOCAB, EOS)


def accepts_whole(compiled: xgr.CompiledGrammar, document: str) -> bool:
    """xgrammar takes ``document`` and then the end: it would be a complete output."""
    matcher = xgr.GrammarMatcher(compiled)
    return matcher.accept_string(document) and matcher.accept_token(EOS)


@pytest.mark.parametrize(("name", "schema", "keyword", "violating"), REFUSED,
                         ids=[r[0] for r in REFUSED])
def test_unenforced_keywords_get_a_value_error_naming_them(
        grammars: GrammarCompilerCache, name: str, schema: dict, keyword: str,
        violating: str | None) -> None:
    with pytest.raises(SchemaRefused, match=f"'{re.escape(keyword)}' \\(at #"):
        check_schema_supported(schema)
    with pytest.raises(ValueError, match=f"'{re.escape(keyword)}'"):
        grammars.compile(S(json=schema))  # the engine's path refuses it too
    if violating is not None:  # why: xgrammar alone takes a document the schema forbids
        compiler = grammars._xgr_compiler()
        compiled = compiler.compile_json_schema(json.dumps(schema), strict_mode=True)
        assert accepts_whole(compiled, violating), violating
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(json.loads(violating), schema,
                                format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def test_date_times_go_unchecked(grammars: GrammarCompilerCache) -> None:
    """Why ``format: date-time`` is refused (jsonschema cannot check it here: it needs an
    optional package): xgrammar takes the 31st of February."""
    compiler = grammars._xgr_compiler()
    compiled = compiler.compile_json_schema('{"type": "string", "format": "date-time"}')
    assert accepts_whole(compiled, '"2024-02-31T00:00:00Z"')
    with pytest.raises(ValueError, match="day is out of range"):
        datetime.datetime.fromisoformat("2024-02-31T00:00:00+00:00")


def _is_duration(value: str) -> bool:
    return re.fullmatch(r"P(?!$)(\d+Y)?(\d+M)?(\d+W)?(\d+D)?(T(?=\d)(\d+H)?(\d+M)?(\d+S)?)?",
                        value) is not None


#: (name, schema, extra check) of accepted keywords: every walk output must validate
ACCEPTED = [
    ("type + minimum/maximum", INT, None),
    ("exclusive bounds", {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 3},
     None),
    ("number bounds", {"type": "number", "minimum": 1.5, "maximum": 2.5}, None),
    ("multipleOf on integers", {"type": "integer", "multipleOf": 3, "minimum": -20,
                                "maximum": 20}, None),
    ("enum and const", {"type": "object", "properties": {
        "e": {"enum": [{"a": 1}, [1, 2], "s", 3, None]}, "c": {"const": "h\u00e9\"llo"}},
        "required": ["e", "c"]}, None),
    ("string lengths", {"type": "string", "minLength": 2, "maxLength": 3}, None),
    ("pattern", {"type": "string", "pattern": "^[a-c]{2}[0-9]$"}, None),
    ("format uuid", {"type": "string", "format": "uuid"}, lambda v: uuid.UUID(v)),
    ("format ipv6", {"type": "string", "format": "ipv6"}, lambda v: ipaddress.IPv6Address(v)),
    ("format duration", {"type": "string", "format": "duration"},
     lambda v: _is_duration(v) or pytest.fail(v)),
    ("array bounds", {"type": "array", "items": {"enum": [1, 2]}, "minItems": 2,
                      "maxItems": 3, "uniqueItems": False}, None),
    ("prefixItems, items false", {"type": "array", "prefixItems": [{"enum": [1]},
                                                                   {"enum": ["x"]}],
                                  "items": False}, None),
    ("prefixItems, then items", {"type": "array", "prefixItems": [{"enum": [1]}],
                                 "items": {"enum": [7]}, "maxItems": 3}, None),
    ("properties, required, additionalProperties false",
     {**OBJ_AB, "required": ["b"], "additionalProperties": False}, None),
    ("additionalProperties schema", {"type": "object", "properties": {"a": {"enum": [1]}},
                                     "additionalProperties": {"type": "integer", "minimum": 0,
                                                              "maximum": 3},
                                     "maxProperties": 3}, None),
    ("patternProperties", {"type": "object", "patternProperties": {"^x[0-9]$": {"enum": [1]}},
                           "additionalProperties": False, "maxProperties": 3}, None),
    ("propertyNames", {"type": "object", "propertyNames": {"pattern": "^[ab]$"},
                       "additionalProperties": {"enum": [1]}}, None),
    ("min/maxProperties", {"type": "object", "properties": {
        "a": {"enum": [1]}, "b": {"enum": [2]}, "c": {"enum": [3]}},
        "minProperties": 2, "maxProperties": 2}, None),
    ("anyOf", {"anyOf": [INT, {"type": "string", "maxLength": 3}]}, None),
    ("oneOf by type", {"oneOf": [INT, {"type": "string", "maxLength": 3},
                                 {"type": "null"}]}, None),
    ("oneOf by discriminator ($ref, as pydantic writes it)", {
        "$defs": {"Cat": {"type": "object", "properties": {"k": {"const": "cat"},
                                                           "v": INT}, "required": ["k", "v"]},
                  "Dog": {"type": "object", "properties": {"k": {"const": "dog"},
                                                           "v": {"type": "boolean"}},
                          "required": ["k", "v"]}},
        "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
        "discriminator": {"propertyName": "k"}}, None),
    ("allOf, one branch", {"allOf": [INT], "title": "t"}, None),
    ("type list", {"type": ["integer", "null"], "minimum": 0, "maximum": 5}, None),
    ("recursion through $ref", {"$defs": {"n": {"type": "object", "properties": {
        "c": {"type": "array", "items": {"$ref": "#/$defs/n"}, "maxItems": 2}},
        "required": ["c"]}}, "$ref": "#/$defs/n"}, None),
    ("strings never hold raw control characters", {"type": "array", "items": {
        "type": "string", "maxLength": 3}, "maxItems": 4}, None),
]


@pytest.mark.parametrize(("name", "schema", "check"), ACCEPTED, ids=[a[0] for a in ACCEPTED])
def test_every_accepted_keyword_holds_in_every_sample(
        grammars: GrammarCompilerCache, walker: GrammarWalker, name: str, schema: dict,
        check: object) -> None:
    check_schema_supported(schema)
    compiled = grammars.compile(S(json=schema))
    rng = np.random.default_rng(0)
    validator = jsonschema.Draft202012Validator(schema)
    outputs = [walker.sample(compiled, rng) for _ in range(40)]
    complete = [o for o in outputs if o is not None]
    assert len(complete) >= 20, f"only {len(complete)} of 40 walks ended"
    for text in complete:
        value = json.loads(text)  # strict: a raw control character in a string fails here
        errors = [e.message for e in validator.iter_errors(value)]
        assert not errors, (text, errors)
        if check is not None:
            check(value)


def test_bounded_strings_refuse_control_characters(grammars: GrammarCompilerCache) -> None:
    """xgrammar 0.2.9 lets U+0000..U+001F into strings with a length bound (invalid JSON);
    the compiled grammar does not."""
    schema = {"type": "string", "maxLength": 4}
    raw = grammars._xgr_compiler().compile_json_schema(json.dumps(schema), strict_mode=True)
    assert accepts_whole(raw, '"a\x03"')
    ours = grammars.compile(S(json=schema))
    assert not accepts_whole(ours, '"a\x03"') and not accepts_whole(ours, '"a\tb"')
    assert accepts_whole(ours, '"a\\tb"') is False  # escapes are not in bounded strings
    assert accepts_whole(ours, '"a b"')
