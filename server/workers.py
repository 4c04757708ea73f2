"""Request work off the event loop, in bounded pools, so ``/health`` and ``/metrics`` answer at
once whatever a request body holds:

    body over INLINE_BYTES -> a worker process: json.loads + limits + pydantic (they hold the
                              GIL: 4 MiB of `[[1],[1],...]` takes ~0.6 s to parse, ~3 s to
                              validate, and a thread would stall the loop all that time)
    small body             -> parsed on the loop (at most a few ms)
    tokenise, chat template, detokenise -> worker threads (the Rust tokenizer releases the GIL
                              while encoding and batch-decoding; Jinja templates are Python,
                              which hands the GIL over every few ms)
    whole response bodies       -> body threads (server/bodies.py; never refused: their request
                              already ran)

Every pool's threads exist from the start, so the server's thread count does not depend on how
many jobs once overlapped.

At most ``max_pending`` tokenizer jobs wait or run (the server passes
``--max-waiting-requests``: a request being prepared counts like one waiting in the engine), and
at most ``max_pending_bytes`` of bodies wait for the parser process; one more is refused with
:class:`ServerBusyError` (HTTP 503 + Retry-After), so a flood of large bodies cannot queue
without limit. A worker process that dies (killed, out of memory) fails its job with 503 and
the pool is started again for the next one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import threading
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from vmkv.chat_template import chat_token_ids
from vmkv.server.limits import BodyError, InputLimits, check_body, loads

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

INLINE_BYTES = 16 << 10  # bodies up to this size are parsed on the loop (< ~3 ms worst case)
THREADS = 2
PROCESSES = 1
MAX_PENDING = 1024  # tokenizer jobs waiting or running
MAX_PENDING_BYTES = 64 << 20  # bytes of bodies waiting for (or in) the parser process


def started_pool(threads: int, name: str) -> concurrent.futures.ThreadPoolExecutor:
    """A thread pool whose ``threads`` threads all exist on return (a pool starts a thread
    only when every one it has is busy: each job here waits until all have started)."""
    pool = concurrent.futures.ThreadPoolExecutor(threads, name)
    barrier = threading.Barrier(threads)
    for job in [pool.submit(barrier.wait) for _ in range(threads)]:
        job.result()
    return pool


class ServerBusyError(RuntimeError):
    """The worker pool already has ``max_pending`` jobs; retry later."""


class InvalidBody(ValueError):
    """Pydantic refused a body; ``errors`` as ``ValidationError.errors()`` gives them."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__(errors[0]["msg"] if errors else "invalid request")
        self.errors = errors

    def __reduce__(self) -> tuple:  # crosses from a worker process intact
        return type(self), (self.errors,)


def parse_body(body: bytes, model: type[M], limits: InputLimits) -> M:
    """``model`` from a JSON body, after the limits (runs in a worker process or inline).

    Raises BodyError (a limit, malformed JSON: param named) or InvalidBody (pydantic)."""
    try:
        obj = loads(body)
    except BodyError:
        raise
    except ValueError as exc:  # json.JSONDecodeError, UnicodeDecodeError
        raise BodyError(f"malformed JSON body: {exc}") from None
    check_body(obj, limits)
    try:
        return model.model_validate(obj)
    except ValidationError as exc:  # picklable: no context objects, no input echoed back
        raise InvalidBody(exc.errors(include_url=False, include_context=False,
                                     include_input=False)) from None


class Workers:
    """The server's pools: one worker process for large bodies, threads for tokenizer work."""

    def __init__(self, tokenizer: Any, limits: InputLimits, *, threads: int = THREADS,
                 processes: int = PROCESSES, max_pending: int = MAX_PENDING,
                 max_pending_bytes: int = MAX_PENDING_BYTES,
                 inline_bytes: int = INLINE_BYTES) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.inline_bytes = inline_bytes
        self.processes = processes
        self._threads = started_pool(threads, "vmkv-worker")
        self._bodies = started_pool(threads, "vmkv-body")
        self._procs: concurrent.futures.ProcessPoolExecutor | None = None
        self._limit = {"thread": max_pending, "process": max_pending_bytes}
        self._pending = {"thread": 0, "process": 0}  # jobs; bytes

    # -- bodies -----------------------------------------------------------------------------
    async def parse(self, body: bytes, model: type[M]) -> M:
        """``model`` from ``body`` (:func:`parse_body`), off the loop when the body is large."""
        if len(body) <= self.inline_bytes:
            return parse_body(body, model, self.limits)
        if self._procs is None:  # spawn: the engine's threads and OpenMP must not be forked
            self._procs = concurrent.futures.ProcessPoolExecutor(
                self.processes, mp_context=multiprocessing.get_context("spawn"))
        try:
            return await self._bounded("process", len(body), self._procs, parse_body, body,
                                       model, self.limits)
        except BrokenProcessPool:
            self._procs.shutdown(wait=False, cancel_futures=True)
            self._procs = None
            raise ServerBusyError("a request parser process died; retry") from None

    # -- tokenizer work ---------------------------------------------------------------------
    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt (with the model's special tokens, as for generation, unless
        ``add_special_tokens`` is false)."""
        return await self.run(
            lambda: self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    async def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                          tools: list[dict[str, Any]] | None = None, **options: Any
                          ) -> list[int]:
        """Token ids of a chat (its template rendered with ``tools`` when given, and the
        options of :func:`vmkv.chat_template.chat_token_ids`)."""
        return await self.run(chat_token_ids, self.tokenizer, messages, add_generation_prompt,
                              tools, **options)

    async def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """``tokenizer.decode(ids)``. Where that is exactly the Rust tokenizer's decode (no
        clean-up pass), its batch form runs instead: it releases the GIL, plain decode does
        not (a 160k-token decode held the event loop 60 ms)."""
        backend = getattr(self.tokenizer, "_tokenizer", None)
        if hasattr(backend, "decode_batch") and not getattr(
                self.tokenizer, "clean_up_tokenization_spaces", True):
            return (await self.run(backend.decode_batch, [ids], skip_special_tokens))[0]
        return await self.run(self.tokenizer.decode, ids,
                              skip_special_tokens=skip_special_tokens)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on a worker thread."""
        return await self._bounded("thread", 1, self._threads, lambda: fn(*args, **kwargs))

    async def build(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a body thread: a response body (never refused, unlike the
        tokenizer work: its request already ran)."""
        return await asyncio.get_running_loop().run_in_executor(self._bodies, fn, *args)

    # -- plumbing ---------------------------------------------------------------------------
    async def _bounded(self, pool: str, cost: int, executor: concurrent.futures.Executor,
                       fn: Callable[..., T], *args: Any) -> T:
        if self._pending[pool] + cost > self._limit[pool] and self._pending[pool]:
            raise ServerBusyError(f"too many requests are already being prepared ({pool} "
                                  "pool full); retry later")
        self._pending[pool] += cost
        try:
            return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)
        finally:
            self._pending[pool] -= cost

    def close(self) -> None:
        """Stop the pools (queued jobs are dropped, the worker process exits)."""
        self._threads.shutdown(wait=False, cancel_futures=True)
        self._bodies.shutdown(wait=False, cancel_futures=True)
        if self._procs is not None:
            self._procs.shutdown(wait=False, cancel_futures=True)
            self._procs = None
