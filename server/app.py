"""The OpenAI-compatible HTTP API over a :class:`~vmkv.engine.front.ServingEngine` (one
in-process :class:`~vmkv.engine.async_engine.AsyncEngine`, or data-parallel replicas).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``, ``GET /version``, ``GET /metrics``, ``POST /tokenize``, ``POST /detokenize``.
Every request is tokenised here, off the event loop (vmkv/server/workers.py); the engine thread
only schedules and runs steps. A client that disconnects has its requests aborted (KV freed) at
once, streaming or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import vmkv
from vmkv.chat_template import NoChatTemplateError
from vmkv.config import ServerConfig
from vmkv.engine.async_engine import EngineDeadError
from vmkv.engine.front import ServingEngine
from vmkv.engine.front import Stream as RequestStream
from vmkv.engine.llm_engine import LLMEngine
from vmkv.engine.outputs import OutputAccumulator, RequestOutput
from vmkv.kernels import cpu_kernels
from vmkv.models.default_model import DEFAULT_MODEL, is_default_name
from vmkv.sampling_params import RequestOutputKind, SamplingParams
from vmkv.server import responses as R
from vmkv.server.auth import ApiKey
from vmkv.server.errors import RETRY_AFTER, APIError, error_response, install_error_handlers
from vmkv.server.limits import InputLimits
from vmkv.server.metrics import Metrics
from vmkv.server.prompt_logprobs import (
    echo_logprobs,
    prompt_logprobs_wanted,
    vllm_prompt_logprobs,
)
from vmkv.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from vmkv.server.schema import install_request_schemas, request_body
from vmkv.server.shutdown import Admission, Lifecycle
from vmkv.server.structured import prepare_structure
from vmkv.server.tools import ToolPlan, plan_tools
from vmkv.server.workers import MAX_PENDING, Workers

M = TypeVar("M")


class _BodyLimit:
    """ASGI middleware: bodies over ``limit`` bytes get 413 before the app reads them."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            response = error_response(413, f"request body over {self.limit} bytes")
            return await response(scope, receive, send)
        seen = 0

        async def limited() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:  # FastAPI turns other errors here into a generic 400
                raise StarletteHTTPException(413, f"request body over {self.limit} bytes")
            return message

        return await self.app(scope, limited, send)


def served_name(model: str | None) -> str:
    """The name a model is served under when none is given: its folder's (or file's) name."""
    return DEFAULT_MODEL if is_default_name(model) else Path(model).name


def build_app(engine: ServingEngine, config: ServerConfig) -> FastAPI:
    """The FastAPI application; ``engine`` must already run. Without a
    ``config.served_model_name`` the model is served under :func:`served_name`."""
    if config.served_model_name is None:
        config = replace(config, served_model_name=served_name(engine.front.config.model))
    metrics = Metrics(config.served_model_name)
    lifecycle = Lifecycle(engine, metrics)
    front = engine.front
    limits = InputLimits.for_model(front.tokenizer, front.max_model_len,
                                   front.vocab_size)
    workers = Workers(front.tokenizer, limits,
                      max_pending=config.max_waiting_requests or MAX_PENDING)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        workers.close()  # the worker threads and the parser process end with the server

    app = FastAPI(title="vmkv", version=vmkv.__version__, lifespan=lifespan)
    install_error_handlers(app)
    api = _Api(engine, config, metrics, workers, lifecycle)
    # outermost last: the key is checked first, then draining, then the body's size
    app.add_middleware(_BodyLimit, limit=config.max_body_bytes)
    app.add_middleware(Admission, lifecycle=lifecycle)
    if config.api_key:
        app.add_middleware(ApiKey, key=config.api_key)

    # which C++ kernels a CPU engine runs (a library that failed to build: what runs instead)
    health_body: dict[str, Any] = {"status": "ok"}
    if front.config.device == "cpu":
        health_body["cpu_kernels"] = cpu_kernels.status()

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_alive:
            return error_response(503, f"the engine loop died: {engine.dead!r}")
        if lifecycle.draining:
            return error_response(503, "draining: the server is shutting down",
                                  headers=RETRY_AFTER)
        return JSONResponse(health_body)

    @app.get("/version")
    async def version() -> dict:
        return {"version": vmkv.__version__}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": config.served_model_name, "object": "model", "created": int(time.time()),
            "owned_by": "vmkv", "root": served_name(front.config.model),  # no local paths
            "max_model_len": front.max_model_len,
        }]}

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        await metrics.refresh(engine)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict:
        dropped = sum(await engine.call_all(LLMEngine.reset_prefix_cache))
        return {"dropped_units": dropped}

    # bodies are parsed by api.parse (off the loop when large), not by FastAPI on the loop;
    # request_body() puts their models in the OpenAPI description all the same
    @app.post("/tokenize", openapi_extra=request_body(TokenizeRequest))
    async def tokenize(raw: Request) -> dict:
        body = await api.parse(raw, TokenizeRequest)
        api.check_model(body.model)
        if body.messages is not None:
            ids = await api.chat_ids([m.as_dict() for m in body.messages],
                                     body.add_generation_prompt)
        else:
            ids = await workers.run(lambda: front.tokenizer(
                body.prompt, add_special_tokens=body.add_special_tokens).input_ids)
        return {"tokens": ids, "count": len(ids), "max_model_len": front.max_model_len}

    @app.post("/detokenize", openapi_extra=request_body(DetokenizeRequest))
    async def detokenize(raw: Request) -> dict:
        body = await api.parse(raw, DetokenizeRequest)
        api.check_model(body.model)
        return {"prompt": await workers.decode(body.tokens)}

    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
    async def completions(raw: Request) -> Response:
        return await api.completions(await api.parse(raw, CompletionRequest), raw)

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
    async def chat_completions(raw: Request) -> Response:
        return await api.chat(await api.parse(raw, ChatCompletionRequest), raw)

    install_request_schemas(app, [CompletionRequest, ChatCompletionRequest, TokenizeRequest,
                                  DetokenizeRequest])
    app.state.metrics = metrics
    app.state.lifecycle = lifecycle
    app.state.workers = workers
    return app


class _Api:
    """The generation endpoints' logic, kept out of the route table."""

    def __init__(self, engine: ServingEngine, config: ServerConfig, metrics: Metrics,
                 workers: Workers, lifecycle: Lifecycle) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.workers = workers
        self.lifecycle = lifecycle
        self.front = engine.front
        self.tokenizer = self.front.tokenizer
        self.token_text = R.TokenText(self.tokenizer)

    async def parse(self, raw: Request, model: type[M]) -> M:
        """The body as ``model``, after vmkv/server/limits.py's checks (off the loop when
        large, vmkv/server/workers.py)."""
        return await self.workers.parse(await raw.body(), model)

    async def encode(self, prompt: str) -> list[int]:
        ids = await self.workers.encode(prompt)
        self.workers.limits.check_prompt_tokens(len(ids))
        return ids

    # -- checks -------------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.served_model_name:
            raise APIError(404, f"The model `{name}` does not exist.", "model")

    def check_n(self, n: int) -> None:
        if not 1 <= n <= self.config.max_n:
            raise APIError(400, f"n must be in 1..{self.config.max_n}, got {n}", "n")

    async def chat_ids(self, messages: list[dict], add_generation_prompt: bool,
                       tools: list[dict] | None = None) -> list[int]:
        try:
            ids = await self.workers.encode_chat(messages, add_generation_prompt, tools)
        except NoChatTemplateError as exc:
            raise APIError(400, f"{exc}; use /v1/completions") from None
        self.workers.limits.check_prompt_tokens(len(ids), "messages")
        return ids

    # -- submit / collect ---------------------------------------------------------------------
    async def submit(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                     cache_salt: str | None) -> list[RequestStream]:
        """Queue one engine request per prompt, all or none; their streams yield deltas."""
        if self.lifecycle.aborting:  # past the shutdown deadline: nothing new starts
            raise APIError(503, "the server is shutting down", headers=RETRY_AFTER)
        params = replace(params, output_kind=RequestOutputKind.DELTA)
        streams: list[RequestStream] = []
        try:
            for i, ids in enumerate(prompts):
                streams.append(await self.engine.add(
                    f"{request_id}-{i}", ids, params, cache_salt,
                    max_waiting=self.config.max_waiting_requests or None))
        except BaseException:
            for s in streams:
                s.abort()
            raise
        return streams

    def _deadline(self, streams: list[RequestStream], started: float
                  ) -> asyncio.TimerHandle | None:
        """Abort the streams ``--request-timeout`` seconds after ``started`` (they still get
        their final output: finish_reason "abort", stop_reason "timeout")."""
        timeout = self.config.request_timeout
        if timeout is None:
            return None

        async def expire() -> None:
            self.metrics.timeouts.labels(self.metrics.model_name).inc()
            with contextlib.suppress(EngineDeadError):  # then the streams end with it anyway
                for s in streams:
                    await self.engine.abort(s.request_id, "timeout")

        loop = asyncio.get_running_loop()
        return loop.call_later(max(0.0, started + timeout - time.monotonic()),
                               lambda: asyncio.ensure_future(expire()))

    async def merged(self, streams: list[RequestStream], started: float
                     ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Deltas of several streams as they come, with latency metrics observed.

        Bounded: a consumer that stops (a client that stops reading) leaves at most one delta
        per stream here; the streams merge what comes meanwhile (vmkv/engine/async_engine.py).
        """
        queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))
        last: dict[int, tuple[float | None, int]] = {}

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    await queue.put((i, out))
            except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
                await queue.put((i, exc))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        timer = self._deadline(streams, started)
        try:
            remaining = len(streams)
            while remaining:
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.error is not None:  # its KV memory was refused: the request failed
                    raise APIError(503, item.error)
                self._observe(i, item, started, last)
                if item.finished:
                    remaining -= 1
                yield i, item
        finally:
            if timer is not None:
                timer.cancel()
            for t in tasks:
                t.cancel()
            for s in streams:
                s.abort()

    def _observe(self, i: int, out: RequestOutput, started: float,
                 last: dict[int, tuple[float | None, int]]) -> None:
        now = time.monotonic()
        prev_time, prev_tokens = last.get(i, (None, 0))
        tokens = prev_tokens + sum(len(c.token_ids) for c in out.outputs)
        if prev_time is None and tokens:
            self.metrics.ttft.observe(now - started)
        elif prev_time is not None and tokens > prev_tokens:
            gap = (now - prev_time) / (tokens - prev_tokens)
            for _ in range(tokens - prev_tokens):
                self.metrics.itl.observe(gap)
        if tokens:
            last[i] = (now, tokens)
        if out.finished:
            self.metrics.e2e.observe(now - started)

    async def collect(self, raw: Request, streams: list[RequestStream], started: float
                      ) -> list[RequestOutput]:
        """Final outputs (the deltas added up); a client that disconnects meanwhile aborts
        the requests."""
        sums = [OutputAccumulator() for _ in streams]
        final: list[RequestOutput | None] = [None] * len(streams)

        async def run() -> None:
            async for i, out in self.merged(streams, started):
                sums[i].add(out)
                if out.finished:
                    final[i] = sums[i].take()

        task = asyncio.create_task(run())
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await raw.is_disconnected():
                task.cancel()
                for s in streams:
                    s.abort()
                raise APIError(499, "client disconnected")
        task.result()
        return [o for o in final if o is not None]

    # -- /v1/completions ----------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, raw: Request) -> Response:
        started = time.monotonic()
        self.check_model(body.model)
        self.check_n(body.n)
        prompts: list[list[int]] = []
        for p in body.prompts():  # token ids were checked with the body (limits.py)
            prompts.append(await self.encode(p) if isinstance(p, str) else list(p))
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        params = body.sampling_params(max_tokens, body.logprobs,
                                      prompt_logprobs=prompt_logprobs_wanted(body, max_tokens),
                                      structured_outputs=await prepare_structure(self.front, body))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        # before submitting: a busy decode pool must not leave submitted requests running
        echo = [await self.workers.decode(p) if body.echo else "" for p in prompts]
        streams = await self.submit(request_id, prompts, params, body.cache_salt)
        model, n = self.config.served_model_name, body.n
        if body.stream:
            return StreamingResponse(
                R.ending_with_errors(self._stream_completion(
                    request_id, model, streams, started, n, echo, body, sum(map(len, prompts)))),
                media_type="text/event-stream")
        outs = await self.collect(raw, streams, started)
        choices = []
        for i, out in enumerate(outs):
            for c in out.outputs:
                choice = {"index": i * n + c.index, "text": echo[i] + c.text,
                          "logprobs": None, "finish_reason": c.finish_reason,
                          "stop_reason": c.stop_reason}
                if body.logprobs is not None:
                    choice["logprobs"] = R.completion_logprobs(
                        self.token_text, c.token_ids, c.logprobs or [], len(echo[i]),
                        body.logprobs)
                    if body.echo:  # a prompt's worth of tokens: decoded off the loop
                        choice["logprobs"] = await asyncio.to_thread(
                            echo_logprobs, self.token_text, out, choice["logprobs"],
                            body.logprobs)
                if body.prompt_logprobs is not None:  # vLLM's extra, echo or not
                    choice["prompt_logprobs"] = await asyncio.to_thread(
                        vllm_prompt_logprobs, self.token_text, out)
                choices.append(choice)
        return JSONResponse({
            **R.envelope(request_id, "text_completion", model), "choices": choices,
            "usage": R.usage(sum(o.num_prompt_tokens for o in outs),
                             sum(len(c.token_ids) for o in outs for c in o.outputs),
                             sum(o.num_cached_tokens for o in outs)),
        })

    async def _stream_completion(self, request_id: str, model: str,
                                 streams: list[RequestStream], started: float, n: int,
                                 echo: list[str], body: CompletionRequest, prompt_tokens: int
                                 ) -> AsyncIterator[str]:
        base = R.envelope(request_id, "text_completion", model)
        text_offsets: dict[int, int] = {}  # per choice: characters streamed so far
        prompts: dict[int, RequestOutput] = {}  # per prompt: its first delta (echo's logprobs)
        completion_tokens = cached = 0
        async for i, out in self.merged(streams, started):
            prompts.setdefault(i, out)
            for c in out.outputs:
                index = i * n + c.index
                if index not in text_offsets:
                    text_offsets[index] = len(echo[i])
                    if echo[i]:
                        lp = (await asyncio.to_thread(echo_logprobs, self.token_text,
                                                      prompts[i], None, body.logprobs)
                              if body.logprobs is not None else None)
                        yield R.sse({**base, "choices": [{"index": index, "text": echo[i],
                                                          "logprobs": lp,
                                                          "finish_reason": None}]})
                completion_tokens += len(c.token_ids)
                lp = None
                if body.logprobs is not None:
                    lp = R.completion_logprobs(self.token_text, c.token_ids, c.logprobs or [],
                                               text_offsets[index], body.logprobs)
                text_offsets[index] += len(c.text)
                yield R.sse({**base, "choices": [{
                    "index": index, "text": c.text, "logprobs": lp,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]})
            if out.finished:
                cached += out.num_cached_tokens
        if body.stream_options and body.stream_options.include_usage:
            yield R.sse({**base, "choices": [],
                         "usage": R.usage(prompt_tokens, completion_tokens, cached)})
        yield R.sse("[DONE]")

    # -- /v1/chat/completions -----------------------------------------------------------------
    async def chat(self, body: ChatCompletionRequest, raw: Request) -> Response:
        started = time.monotonic()
        self.check_model(body.model)
        self.check_n(body.n)
        plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls,
                          self.tokenizer.chat_template, self.config.tool_call_parser)
        ids = await self.chat_ids([m.as_dict() for m in body.messages],
                                  body.add_generation_prompt, plan.tools)
        params = body.sampling_params(
            body.requested_max_tokens, body.num_logprobs,
            structured_outputs=await prepare_structure(self.front, body, plan.structure))
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self.submit(request_id, [ids], params, body.cache_salt)
        model = self.config.served_model_name
        if body.stream:
            return StreamingResponse(R.ending_with_errors(self._stream_chat(
                request_id, model, streams, started, body, len(ids), plan)),
                media_type="text/event-stream")
        (out,) = await self.collect(raw, streams, started)
        choices = []
        for c in out.outputs:
            message, finish_reason = plan.message(c.text, c.finish_reason)
            choice = {"index": c.index, "message": message,
                      "logprobs": None, "finish_reason": finish_reason,
                      "stop_reason": c.stop_reason}
            if body.logprobs:
                choice["logprobs"] = R.chat_logprobs(self.token_text, c.token_ids,
                                                     c.logprobs or [], body.top_logprobs or 0)
            choices.append(choice)
        return JSONResponse({
            **R.envelope(request_id, "chat.completion", model), "choices": choices,
            "usage": R.usage(out.num_prompt_tokens, sum(len(c.token_ids) for c in out.outputs),
                             out.num_cached_tokens),
        })

    async def _stream_chat(self, request_id: str, model: str, streams: list[RequestStream],
                           started: float, body: ChatCompletionRequest, prompt_tokens: int,
                           plan: ToolPlan) -> AsyncIterator[str]:
        base = R.envelope(request_id, "chat.completion.chunk", model)
        shapers = {index: plan.stream() for index in range(body.n)}
        completion_tokens = cached = 0
        for index in range(body.n):  # the role comes first, once per choice
            yield R.sse({**base, "choices": [{"index": index, "delta": {"role": "assistant",
                                                                        "content": ""},
                                              "logprobs": None, "finish_reason": None}]})
        async for _, out in self.merged(streams, started):
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                lp = None
                if body.logprobs:
                    lp = R.chat_logprobs(self.token_text, c.token_ids, c.logprobs or [],
                                         body.top_logprobs or 0)
                deltas, finish_reason = shapers[c.index].feed(c.text, c.finish_reason)
                if not deltas and (lp is not None or finish_reason is not None):
                    deltas = [{}]
                for k, delta in enumerate(deltas):
                    last = k == len(deltas) - 1
                    yield R.sse({**base, "choices": [{
                        "index": c.index, "delta": delta, "logprobs": lp if k == 0 else None,
                        "finish_reason": finish_reason if last else None,
                        "stop_reason": c.stop_reason if last else None}]})
            if out.finished:
                cached = out.num_cached_tokens
        if body.stream_options and body.stream_options.include_usage:
            yield R.sse({**base, "choices": [],
                         "usage": R.usage(prompt_tokens, completion_tokens, cached)})
        yield R.sse("[DONE]")
