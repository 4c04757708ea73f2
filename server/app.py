"""The OpenAI-compatible HTTP API over a :class:`~vmkv.engine.front.ServingEngine` (one
in-process :class:`~vmkv.engine.async_engine.AsyncEngine`, or data-parallel replicas): the
application, its middleware and its route table.

One handler per endpoint family serves the routes, all over one shared
:class:`~vmkv.server.session.ServingSession` (parsing, tokenising, submitting, stream merging):

    POST /v1/completions                 CompletionsHandler   server/completions.py
    POST /v1/chat/completions            ChatHandler          server/chat.py
    POST /v1/responses                   ResponsesHandler     server/responses_api.py
    POST /tokenize, /detokenize          TokenizeHandler      server/tokenization.py
    GET /health, /ping, /version,        AdminHandler         server/admin.py
        /v1/models, /metrics; with
        ``dev_mode`` POST /reset_prefix_cache
    POST /invocations (SageMaker's)      InvocationsHandler   server/invocations.py

Every request is tokenised off the event loop (server/workers.py); the engine thread only
schedules and runs steps. A client that disconnects has its requests aborted (KV freed) at
once, streaming or not.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import FastAPI

import vmkv
from vmkv.config import ServerConfig
from vmkv.engine.front import ServingEngine
from vmkv.server.admin import AdminHandler, served_name
from vmkv.server.auth import ApiKey
from vmkv.server.chat import ChatHandler
from vmkv.server.completions import CompletionsHandler
from vmkv.server.errors import install_error_handlers
from vmkv.server.http_options import BodyLimit, EchoRequestId, add_cors
from vmkv.server.invocations import InvocationsHandler
from vmkv.server.limits import InputLimits
from vmkv.server.metrics import Metrics
from vmkv.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from vmkv.server.responses_api import ResponsesHandler
from vmkv.server.responses_request import ResponsesRequest
from vmkv.server.schema import install_request_schemas, request_body
from vmkv.server.session import ServingSession
from vmkv.server.shutdown import Admission, Lifecycle
from vmkv.server.tokenization import TokenizeHandler
from vmkv.server.workers import MAX_PENDING, Workers


def build_app(engine: ServingEngine, config: ServerConfig) -> FastAPI:
    """The FastAPI application; ``engine`` must already run. Without a
    ``config.served_model_name`` the model is served under :func:`served_name`. ValueError
    for a ``chat_template`` or ``generation_config`` that cannot be read."""
    if config.served_model_name is None:
        config = replace(config, served_model_name=(served_name(engine.front.config.model),))
    front = engine.front
    metrics = Metrics(config.served_model_name[0], front.config, front.max_model_len,
                      front.config.data_parallel_size)
    lifecycle = Lifecycle(engine, metrics)
    limits = InputLimits.for_model(front.tokenizer, front.max_model_len, front.vocab_size)
    workers = Workers(front.tokenizer, limits,
                      max_pending=config.max_waiting_requests or MAX_PENDING)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        gc.collect()
        gc.freeze()  # the model and libraries: out of the collector's walks (server/bodies.py)
        yield
        gc.unfreeze()  # what the server leaves behind is collected as usual
        workers.close()  # the worker threads and the parser process end with the server

    app = FastAPI(title="vmkv", version=vmkv.__version__, lifespan=lifespan)
    install_error_handlers(app)
    session = ServingSession(engine, config, metrics, workers, lifecycle)
    # outermost last: CORS preflights are answered first, then the key is checked, then
    # draining, then the body's size; every response carries the request's X-Request-Id
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)
    app.add_middleware(Admission, lifecycle=lifecycle)
    if config.api_key:
        app.add_middleware(ApiKey, keys=config.api_key)
    app.add_middleware(EchoRequestId)
    add_cors(app, config.allowed_origins)
    metrics.instrument(app)  # outermost: every answer counts, refusals included
    _add_routes(app, session, AdminHandler(engine, config, metrics, lifecycle))
    app.state.metrics = metrics
    app.state.lifecycle = lifecycle
    app.state.workers = workers
    return app


def _add_routes(app: FastAPI, session: ServingSession, admin: AdminHandler) -> None:
    """The route table. Bodies are parsed by the handlers (``session.parse``: off the loop when
    large), not by FastAPI on the loop; ``request_body()`` puts their models in the OpenAPI
    description all the same. The route names keep the OpenAPI operation ids."""
    app.get("/health")(admin.health)
    app.api_route("/ping", methods=["GET", "POST"])(admin.ping)  # SageMaker's health check
    app.get("/version")(admin.version)
    app.get("/v1/models")(admin.models)
    app.get("/metrics")(admin.metrics_endpoint)
    if session.config.dev_mode:  # vLLM's development routes: only when asked for
        app.post("/reset_prefix_cache")(admin.reset_prefix_cache)
    tokens = TokenizeHandler(session)
    app.post("/tokenize", openapi_extra=request_body(TokenizeRequest))(tokens.tokenize)
    app.post("/detokenize", openapi_extra=request_body(DetokenizeRequest))(tokens.detokenize)
    completions, chat = CompletionsHandler(session).create, ChatHandler(session).create
    app.post("/v1/completions", name="completions",
             openapi_extra=request_body(CompletionRequest))(completions)
    app.post("/v1/chat/completions", name="chat_completions",
             openapi_extra=request_body(ChatCompletionRequest))(chat)
    app.post("/invocations", name="invocations")(
        InvocationsHandler(session, chat, completions).create)
    app.post("/v1/responses", name="responses",
             openapi_extra=request_body(ResponsesRequest))(ResponsesHandler(session).create)
    install_request_schemas(app, [CompletionRequest, ChatCompletionRequest, TokenizeRequest,
                                  DetokenizeRequest, ResponsesRequest])
