"""What a server needs from an engine, and the interface both engine kinds offer it.

The HTTP server never reaches into :class:`~vmkv.engine.llm_engine.LLMEngine`: it reads an
:class:`EngineFront` (tokenizer, context limit, vocabulary width, grammar compiler, config) and
drives a :class:`ServingEngine`. Two engines provide both:

    AsyncEngine          one LLMEngine on a thread of this process; front = EngineFront.of(llm)
    DataParallelEngine   N replica processes (vmkv/engine/data_parallel.py);
                         front = EngineFront.load(config): no weights in this process

Functions handed to :meth:`ServingEngine.call_all` run in the replica that owns the engine,
which may be another process: they must be picklable (module-level functions or methods such as
``LLMEngine.reset_prefix_cache``, never lambdas).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from vmkv.config import EngineConfig, resolve_max_model_len
from vmkv.sampling_params import SamplingParams
from vmkv.structured.compiler import GrammarCompilerCache, check_schema_supported
from vmkv.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from vmkv.engine.llm_engine import LLMEngine
    from vmkv.engine.outputs import RequestOutput


@dataclass(frozen=True)
class EngineFront:
    """The engine facts a server reads, available without the model's weights.

    Attributes:
        config: the EngineConfig the engine was built from.
        tokenizer: the HF tokenizer (requests are tokenised at the edge).
        max_model_len: longest prompt + output.
        vocab_size: width of the model's logits (token ids must be below it).
        grammars: ``grammars.compile(params)`` refuses a bad constraint (ValueError) before
            it is queued: the engine's own compiler and cache (the engine thread then finds
            the grammar compiled), or, in front of replicas, only the checks that need no
            compile (:class:`ReplicaGrammars`).
    """

    config: EngineConfig
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    grammars: GrammarCompilerCache | ReplicaGrammars

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineFront:
        """The front of an engine of this process (sharing its tokenizer and the grammar cache
        of its input processor, so a grammar the server checks early is compiled once)."""
        return cls(engine.config, engine.tokenizer, engine.max_model_len,
                   engine.model_config.vocab_size, engine.processor.grammars)

    @classmethod
    def load(cls, config: EngineConfig) -> EngineFront:
        """The front of engines built from ``config`` in other processes (replicas), reading
        only the model's config and tokenizer (ValueError as the engine would raise for a bad
        model or ``max_model_len``)."""
        from vmkv.models import load_model_config, load_tokenizer, resolve_model

        path = resolve_model(config.model)
        model_config = load_model_config(path)
        tokenizer = load_tokenizer(config.tokenizer or path)
        return cls(config, tokenizer, resolve_max_model_len(config.max_model_len,
                                                             model_config.max_model_len),
                   model_config.vocab_size, ReplicaGrammars())


class ReplicaGrammars:
    """The grammar checks of a front whose engines run in replica processes: only those that
    need no compile. The replica that runs a request compiles its grammar, once, on a helper
    thread while it steps (vmkv/engine/dispatcher.py), and refuses a grammar xgrammar cannot
    compile with ValueError from ``add``: compiling here as well would compile every grammar
    twice."""

    @staticmethod
    def compile(params: StructuredOutputsParams) -> None:
        """ValueError if ``params`` uses a JSON-schema keyword that would not be enforced."""
        if params.kind == "json":
            check_schema_supported(json.loads(params.json))


class Stream(Protocol):
    """One submitted request: async-iterates its cumulative outputs; ``abort()`` stops it.
    ``params``: what it was submitted with; ``engine_index``: the replica that runs it (0
    with one engine)."""

    request_id: str
    params: SamplingParams
    engine_index: int

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    def abort(self) -> None: ...


class ServingEngine(Protocol):
    """The asyncio interface the server drives (``AsyncEngine``, ``DataParallelEngine``).

    ``add`` raises ValueError (bad request), EngineOverloadedError (``max_waiting`` sequences
    already wait; per replica) or EngineDeadError; a dead engine has ``is_alive`` False and
    ``dead`` says why (for a replica set: which replica).
    """

    front: EngineFront
    dead: BaseException | None

    @property
    def is_alive(self) -> bool: ...

    async def add(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                  cache_salt: str | None = None, *, max_waiting: int | None = None
                  ) -> Stream: ...

    async def abort(self, request_id: str, reason: str | None = None) -> None: ...

    async def abort_all(self, reason: str | None = None) -> int: ...

    async def call_all(self, fn: Callable[[LLMEngine], Any]) -> list[Any]:
        """``fn(engine)`` on every replica between steps; one result per replica, in order."""
        ...

    def shutdown(self, timeout: float = 10.0) -> None: ...
