"""Compile structured-output params into xgrammar grammars, once per distinct params.

``GrammarCompilerCache.compile`` is thread-safe and cached (LRU over the hashable params), so
the server compiles a request's grammar in a worker thread before submitting it and the engine
thread, which asks again at ``add_request``, only finds it in the cache; an engine loop given a
request whose grammar is not compiled yet compiles it on a helper thread first
(vmkv/engine/dispatcher.py), so steps never wait for a compile. Everything xgrammar cannot parse,
and JSON-schema keywords it would silently not enforce (``schema_check.py``), is a
``ValueError``.

xgrammar (which imports pydantic) is imported on the first structured request only, so an engine
that serves none runs where it is absent (the GPU image).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vmkv.structured.matcher import GrammarState
from vmkv.structured.params import StructuredOutputsParams
from vmkv.structured.schema_check import check_schema_supported

if TYPE_CHECKING:
    import xgrammar as xgr

#: distinct grammars kept compiled (xgrammar's own cache holds the intermediate work)
CACHE_SIZE = 512

#: longest run of whitespace JSON output may have between tokens (vmkv's choice: unbounded
#: whitespace, vLLM's default, lets small models loop on newlines and tabs until max_tokens;
#: 24 still allows pretty-printing five levels deep)
MAX_WHITESPACE_RUN = 24

#: JSON strings of bounded length are compiled by xgrammar 0.2.9 as ``[^"\\\r\n]{m,n}``,
#: which lets raw control characters (U+0000..U+001F) into a string: invalid JSON. The grammar
#: text is patched to refuse them (as its unbounded strings already do).
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'


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
                return compiler.compile_grammar(json_grammar(params))
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(params.choice))
            return compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"invalid structured_outputs.{kind}: {_reason(exc)}") from None

    def new_state(self, params: StructuredOutputsParams,
                  after_token: int | None = None) -> GrammarState:
        """A fresh matcher for one sequence (compiles, or takes the grammar from the cache);
        with ``after_token`` it applies only after that token (:class:`GrammarState`)."""
        return GrammarState(self.compile(params), after_token=after_token)


def json_grammar(params: StructuredOutputsParams) -> str:
    """The EBNF grammar of a ``json`` or ``json_object`` constraint (json_object: any object),
    whose strings never hold a raw control character."""
    import xgrammar as xgr

    schema = params.json if params.kind == "json" else '{"type": "object"}'
    grammar = xgr.Grammar.from_json_schema(
        schema, strict_mode=params.kind == "json",
        any_whitespace=not params.disable_any_whitespace, max_whitespace_cnt=MAX_WHITESPACE_RUN)
    return str(grammar).replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose only sentences are ``choices`` (JSON string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _reason(exc: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(exc).strip()
    head, sep, tail = text.partition(": ")
    return tail if sep and (".cc:" in head or head.startswith("[")) else text
