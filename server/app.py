"""The OpenAI-compatible HTTP API over an :class:`~vmkv.engine.async_engine.AsyncEngine`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``, ``GET /version``, ``GET /metrics``, ``POST /tokenize``, ``POST /detokenize``.
Every request is tokenised here; the engine thread only schedules and runs steps. A client that
disconnects has its requests aborted (KV freed) at once, streaming or not.
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import vmkv
from vmkv.chat_template import NoChatTemplateError, chat_token_ids
from vmkv.config import ServerConfig
from vmkv.engine.async_engine import AsyncEngine, RequestStream
from vmkv.engine.outputs import RequestOutput
from vmkv.models.default_model import DEFAULT_MODEL, is_default_name
from vmkv.sampling_params import SamplingParams
from vmkv.server import responses as R
from vmkv.server.errors import APIError, error_response, install_error_handlers
from vmkv.server.metrics import Metrics, take_snapshot
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
from vmkv.server.structured import prepare_structure
from vmkv.server.tools import ToolPlan, plan_tools


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


class _ApiKey:
    """ASGI middleware: ``/v1/*`` and ``/reset_prefix_cache`` need ``Authorization: Bearer <key>``
    (constant-time check).

    Pure ASGI rather than ``@app.middleware``: Starlette's BaseHTTPMiddleware wraps the receive
    channel and hides client disconnects from the endpoints.
    """

    def __init__(self, app: Any, key: str) -> None:
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith(("/v1", "/reset_prefix_cache")):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_response(401, "invalid or missing API key")
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def served_name(model: str | None) -> str:
    """The name a model is served under when none is given: its folder's (or file's) name."""
    return DEFAULT_MODEL if is_default_name(model) else Path(model).name


def build_app(engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    """The FastAPI application; ``engine`` must already run. Without a
    ``config.served_model_name`` the model is served under :func:`served_name`."""
    if config.served_model_name is None:
        config = replace(config, served_model_name=served_name(engine.engine.config.model))
    app = FastAPI(title="vmkv", version=vmkv.__version__)
    install_error_handlers(app)
    app.add_middleware(_BodyLimit, limit=config.max_body_bytes)
    metrics = Metrics(config.served_model_name)
    api = _Api(engine, config, metrics)
    llm = engine.engine
    tokenizer = llm.tokenizer

    if config.api_key:
        app.add_middleware(_ApiKey, key=config.api_key)

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_alive:
            return error_response(503, f"the engine loop died: {engine.dead!r}")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": vmkv.__version__}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": config.served_model_name, "object": "model", "created": int(time.time()),
            "owned_by": "vmkv", "root": str(llm.model_path), "max_model_len": llm.max_model_len,
        }]}

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        if engine.is_alive:
            metrics.snapshot = await engine.call(take_snapshot)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict:
        dropped = await engine.call(lambda e: e.reset_prefix_cache())
        return {"dropped_units": dropped}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        api.check_model(body.model)
        if body.messages is not None:
            ids = api.chat_ids([m.as_dict() for m in body.messages], body.add_generation_prompt)
        else:
            ids = tokenizer(body.prompt, add_special_tokens=body.add_special_tokens).input_ids
        return {"tokens": ids, "count": len(ids), "max_model_len": llm.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        api.check_model(body.model)
        api.check_token_ids(body.tokens)
        return {"prompt": tokenizer.decode(body.tokens)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await api.completions(body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await api.chat(body, raw)

    app.state.metrics = metrics
    return app


class _Api:
    """The generation endpoints' logic, kept out of the route table."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig, metrics: Metrics) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.llm = engine.engine
        self.tokenizer = self.llm.tokenizer
        self.token_text = R.TokenText(self.tokenizer)

    # -- checks -------------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.served_model_name:
            raise APIError(404, f"The model `{name}` does not exist.", "model")

    def check_token_ids(self, ids: list[int]) -> None:
        vocab = self.llm.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"token ids must be in [0, {vocab})", "tokens")

    def check_n(self, n: int) -> None:
        if not 1 <= n <= self.config.max_n:
            raise APIError(400, f"n must be in 1..{self.config.max_n}, got {n}", "n")

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool,
                 tools: list[dict] | None = None) -> list[int]:
        try:
            return chat_token_ids(self.tokenizer, messages, add_generation_prompt, tools)
        except NoChatTemplateError as exc:
            raise APIError(400, f"{exc}; use /v1/completions") from None

    # -- submit / collect ---------------------------------------------------------------------
    async def submit(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                     cache_salt: str | None) -> list[RequestStream]:
        """Queue one engine request per prompt, all or none."""
        streams: list[RequestStream] = []
        try:
            for i, ids in enumerate(prompts):
                streams.append(await self.engine.add(f"{request_id}-{i}", ids, params,
                                                     cache_salt))
        except BaseException:
            for s in streams:
                s.abort()
            raise
        return streams

    async def merged(self, streams: list[RequestStream], started: float
                     ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of several streams as they come, with latency metrics observed."""
        queue: asyncio.Queue = asyncio.Queue()
        last: dict[int, tuple[float, int]] = {}

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    await queue.put((i, out))
            except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
                await queue.put((i, exc))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(streams)
            while remaining:
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                self._observe(i, item, started, last)
                if item.finished:
                    remaining -= 1
                yield i, item
        finally:
            for t in tasks:
                t.cancel()
            for s in streams:
                s.abort()

    def _observe(self, i: int, out: RequestOutput, started: float,
                 last: dict[int, tuple[float, int]]) -> None:
        now = time.monotonic()
        tokens = sum(len(c.token_ids) for c in out.outputs)
        prev_time, prev_tokens = last.get(i, (None, 0))
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
        """Final outputs; a client that disconnects meanwhile aborts the requests."""
        final: list[RequestOutput | None] = [None] * len(streams)

        async def run() -> None:
            async for i, out in self.merged(streams, started):
                if out.finished:
                    final[i] = out

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
        for p in body.prompts():
            if isinstance(p, str):
                prompts.append(self.tokenizer(p).input_ids)
            else:
                self.check_token_ids(p)
                prompts.append(list(p))
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        params = body.sampling_params(max_tokens, body.logprobs,
                                      prompt_logprobs=prompt_logprobs_wanted(body, max_tokens),
                                      structured_outputs=await prepare_structure(self.llm, body))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await self.submit(request_id, prompts, params, body.cache_salt)
        model, n = self.config.served_model_name, body.n
        echo = [self.tokenizer.decode(p) if body.echo else "" for p in prompts]
        if body.stream:
            return StreamingResponse(
                self._stream_completion(request_id, model, streams, started, n, echo, body,
                                        sum(map(len, prompts))),
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
                    if body.echo:
                        choice["logprobs"] = echo_logprobs(self.token_text, out,
                                                           choice["logprobs"], body.logprobs)
                if body.prompt_logprobs is not None:  # vLLM's extra, echo or not
                    choice["prompt_logprobs"] = vllm_prompt_logprobs(self.token_text, out)
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
        trackers: dict[int, R.ChoiceTracker] = {}
        completion_tokens = cached = 0
        async for i, out in self.merged(streams, started):
            for c in out.outputs:
                index = i * n + c.index
                tracker = trackers.get(index)
                if tracker is None:
                    tracker = trackers[index] = R.ChoiceTracker(text_offset=len(echo[i]))
                    if echo[i]:
                        lp = (echo_logprobs(self.token_text, out, None, body.logprobs)
                              if body.logprobs is not None else None)
                        yield R.sse({**base, "choices": [{"index": index, "text": echo[i],
                                                          "logprobs": lp,
                                                          "finish_reason": None}]})
                d = tracker.delta(c)
                if d is None:
                    continue
                completion_tokens += len(d.token_ids)
                lp = None
                if body.logprobs is not None:
                    lp = R.completion_logprobs(self.token_text, d.token_ids, d.logprobs,
                                               tracker.text_offset, body.logprobs)
                tracker.text_offset += len(d.text)
                yield R.sse({**base, "choices": [{
                    "index": index, "text": d.text, "logprobs": lp,
                    "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}]})
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
        ids = self.chat_ids([m.as_dict() for m in body.messages], body.add_generation_prompt,
                            plan.tools)
        params = body.sampling_params(
            body.requested_max_tokens, body.num_logprobs,
            structured_outputs=await prepare_structure(self.llm, body, plan.structure))
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self.submit(request_id, [ids], params, body.cache_salt)
        model = self.config.served_model_name
        if body.stream:
            return StreamingResponse(self._stream_chat(request_id, model, streams, started,
                                                       body, len(ids), plan),
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
        trackers: dict[int, R.ChoiceTracker] = {}
        shapers = {index: plan.stream() for index in range(body.n)}
        completion_tokens = cached = 0
        for index in range(body.n):  # the role comes first, once per choice
            yield R.sse({**base, "choices": [{"index": index, "delta": {"role": "assistant",
                                                                        "content": ""},
                                              "logprobs": None, "finish_reason": None}]})
        async for _, out in self.merged(streams, started):
            for c in out.outputs:
                tracker = trackers.setdefault(c.index, R.ChoiceTracker())
                d = tracker.delta(c)
                if d is None:
                    continue
                completion_tokens += len(d.token_ids)
                lp = None
                if body.logprobs:
                    lp = R.chat_logprobs(self.token_text, d.token_ids, d.logprobs,
                                         body.top_logprobs or 0)
                deltas, finish_reason = shapers[c.index].feed(d.text, d.finish_reason)
                if not deltas and (lp is not None or finish_reason is not None):
                    deltas = [{}]
                for k, delta in enumerate(deltas):
                    last = k == len(deltas) - 1
                    yield R.sse({**base, "choices": [{
                        "index": c.index, "delta": delta, "logprobs": lp if k == 0 else None,
                        "finish_reason": finish_reason if last else None,
                        "stop_reason": d.stop_reason if last else None}]})
            if out.finished:
                cached = out.num_cached_tokens
        if body.stream_options and body.stream_options.include_usage:
            yield R.sse({**base, "choices": [],
                         "usage": R.usage(prompt_tokens, completion_tokens, cached)})
        yield R.sse("[DONE]")
