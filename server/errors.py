"""Errors in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from vmkv.engine.async_engine import EngineDeadError, EngineOverloadedError
from vmkv.sampling_params import SamplingParams
from vmkv.server.limits import BodyError
from vmkv.server.workers import InvalidBody, ServerBusyError

logger = logging.getLogger("vmkv.server")

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
          413: "BadRequestError", 422: "BadRequestError", 500: "InternalServerError",
          503: "ServiceUnavailableError"}


_PARAMS = set(SamplingParams.__dataclass_fields__)


class APIError(Exception):
    """An error to return to the client with ``status`` in the OpenAI shape."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "APIError"),
                      "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


#: seconds a client refused for overload should wait before retrying
RETRY_AFTER = {"Retry-After": "1"}


def _validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('msg')}", None
    msg = first.get("msg", "invalid value")
    return (f"{param}: {msg}" if param else msg), param


def _count_rejection(request: Request, reason: str) -> None:
    metrics = getattr(request.app.state, "metrics", None)
    if metrics is not None:
        metrics.rejected.labels(metrics.model_name, reason).inc()


def install_error_handlers(app: FastAPI) -> None:
    """Every failure leaves as an OpenAI-shaped JSON error, never a crash or an HTML page."""

    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc.errors())
        return error_response(400, message, param)

    @app.exception_handler(InvalidBody)
    async def _invalid_body(_: Request, exc: InvalidBody) -> JSONResponse:
        message, param = _validation_message(exc.errors)
        return error_response(400, message, param)

    @app.exception_handler(BodyError)
    async def _body(_: Request, exc: BodyError) -> JSONResponse:
        return error_response(400, str(exc), exc.param)

    @app.exception_handler(EngineOverloadedError)
    async def _overloaded(request: Request, exc: EngineOverloadedError) -> JSONResponse:
        _count_rejection(request, "queue_full")
        return error_response(503, f"the server is overloaded: {exc}; retry later",
                              headers=RETRY_AFTER)

    @app.exception_handler(ServerBusyError)
    async def _busy(request: Request, exc: ServerBusyError) -> JSONResponse:
        _count_rejection(request, "busy")
        return error_response(503, f"the server is busy: {exc}", headers=RETRY_AFTER)

    @app.exception_handler(json.JSONDecodeError)
    async def _json(_: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return error_response(400, f"malformed JSON body: {exc}")

    @app.exception_handler(ValueError)
    async def _value(_: Request, exc: ValueError) -> JSONResponse:
        message = str(exc)
        first = message.split(" ", 1)[0]
        return error_response(400, message, first if first in _PARAMS else None)

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _other(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(500, f"internal error: {type(exc).__name__}")
