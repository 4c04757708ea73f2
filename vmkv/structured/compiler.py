"""Compile structured-output params into xgrammar grammars, once per distinct params.

``GrammarCompilerCache.compile`` is thread-safe and cached (LRU over the hashable params), so
the server compiles a request's grammar in a worker thread before submitting it and the engine
thread, which asks again at ``add_request``, only finds it in the cache; an engine loop given a
request whose grammar is not compiled yet compiles it on a helper thread first
(vmkv/engine/commands.py), so steps never wait for a compile. Everything xgrammar
cannot parse, and JSON-schema keywords it would silently not enforce, is a ``ValueError``.

xgrammar (which imports pydantic) is imported on the first structured request only, so an engine
that serves none runs where it is absent (the GPU image).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vmkv.structured.matcher import GrammarState
from vmkv.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr

#: distinct grammars kept compiled (xgrammar's own cache holds the intermediate work)
CACHE_SIZE = 512

#: longest run of whitespace JSON output may have between tokens (vmkv's choice: unbounded
#: whitespace, vLLM's default, lets small models loop on newlines and tabs until max_tokens;
#: 24 still allows pretty-printing five levels deep)
MAX_WHITESPACE_RUN = 24

#: keywords xgrammar 0.2 accepts but does not enforce (checked in tests/test_structured.py);
#: a schema using them would produce output that does not validate, so it is refused
UNENFORCED_KEYWORDS = ("multipleOf", "contains", "minContains", "maxContains", "not", "if",
                       "then", "else", "dependentSchemas", "dependencies",
                       "unevaluatedProperties", "unevaluatedItems")

#: keys whose value maps names (not keywords) to subschemas
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


@dataclass
class CacheStats:
    """Lookups of :meth:`GrammarCompilerCache.compile` that found the grammar, and compiles."""

    hits: int = 0
    misses: int = 0


class GrammarCompilerCache:
    """xgrammar's compiler for one tokenizer and logits width, with a cache of grammars.

    Args:
        tokenizer: the engine's HF tokenizer.
        vocab_size: the width of the model's logits (may exceed the tokenizer's vocabulary).
        stop_token_ids: the tokens that end a sequence (EOS); a finished grammar allows only them.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._stop_token_ids = list(stop_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()
        self._grammars: OrderedDict[StructuredOutputsParams, xgr.CompiledGrammar] = (
            OrderedDict())
        self.stats = CacheStats()

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar of ``params``, from the cache or compiled now (outside the
        lock: other threads' lookups and compiles go on); ValueError naming what is wrong."""
        with self._lock:
            grammar = self._grammars.get(params)
            if grammar is not None:
                self._grammars.move_to_end(params)
                self.stats.hits += 1
                return grammar
        grammar = self._compile(params)
        with self._lock:
            self.stats.misses += 1
            self._grammars[params] = grammar
            while len(self._grammars) > CACHE_SIZE:
                self._grammars.popitem(last=False)
        return grammar

    def is_compiled(self, params: StructuredOutputsParams) -> bool:
        """Whether :meth:`compile` would find ``params`` in the cache now."""
        with self._lock:
            return params in self._grammars

    def _xgr_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:  # built on first use: engines without structured requests pay nothing
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size,
                    stop_token_ids=self._stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=2)
            return self._compiler

    def _compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar of ``params``; ValueError naming what is wrong."""
        compiler = self._xgr_compiler()
        kind = params.kind
        if kind == "json":
            check_schema_supported(json.loads(params.json))
        try:
            if kind in ("json", "json_object"):
                # json_object: any object (xgrammar's builtin JSON grammar allows any value)
                schema = params.json if kind == "json" else '{"type": "object"}'
                return compiler.compile_json_schema(
                    schema, strict_mode=kind == "json",
                    any_whitespace=not params.disable_any_whitespace,
                    max_whitespace_cnt=MAX_WHITESPACE_RUN)
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(params.choice))
            return compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"invalid structured_outputs.{kind}: {_reason(exc)}") from None

    def new_state(self, params: StructuredOutputsParams) -> GrammarState:
        """A fresh matcher for one sequence (compiles, or takes the grammar from the cache)."""
        return GrammarState(self.compile(params))


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose only sentences are ``choices`` (JSON string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def check_schema_supported(schema: Any) -> None:
    """ValueError if the schema uses a keyword of :data:`UNENFORCED_KEYWORDS` anywhere."""
    for path, keyword in _keywords(schema, "#"):
        if keyword in UNENFORCED_KEYWORDS:
            raise ValueError(f"invalid structured_outputs.json: the JSON-schema keyword "
                             f"{keyword!r} (at {path}) is not supported")


def _keywords(schema: Any, path: str) -> Iterator[tuple[str, str]]:
    """(path, keyword) of every keyword in every subschema of ``schema``."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            yield from _keywords(item, f"{path}/{i}")
        return
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        yield path, key
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                yield from _keywords(sub, f"{path}/{key}/{name}")
        elif key not in ("enum", "const", "default", "examples", "required"):
            yield from _keywords(value, f"{path}/{key}")


def _reason(exc: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(exc).strip()
    head, sep, tail = text.partition(": ")
    return tail if sep and (".cc:" in head or head.startswith("[")) else text
