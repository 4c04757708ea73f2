"""HTTP behaviour around the routes: ``X-Request-Id`` echoed, CORS (``--allowed-origins``),
bodies over ``--max-body-bytes`` refused (413) before the app reads them.

``X-Request-Id``: a request that sends one gets it back on its response (errors, 401s and
streams included), and the completions, chat and responses routes name their response after it
(``chatcmpl-<X-Request-Id>``, as vLLM does). CORS is off unless ``--allowed-origins`` names
origins: vLLM allows every origin by default, but a server without an API key that answers any
web page's script is an open door on the user's machine, so vmkv asks for the choice.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from vmkv.server.errors import error_response

REQUEST_ID = b"x-request-id"
MAX_REQUEST_ID = 256  # longer X-Request-Id headers are not echoed (nor used as ids)


class EchoRequestId:
    """ASGI middleware: the request's ``X-Request-Id`` on its response."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        value = request_id_header(scope) if scope["type"] == "http" else None
        if value is None:
            return await self.app(scope, receive, send)

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != REQUEST_ID]
                message = {**message, "headers": [*headers, (REQUEST_ID, value)]}
            await send(message)

        return await self.app(scope, receive, send_with_id)


class BodyLimit:
    """ASGI middleware: bodies over ``limit`` bytes get 413 before the app reads them (by their
    ``Content-Length``, or, streamed, as soon as the bytes read pass it)."""

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


def request_id_header(scope: dict) -> bytes | None:
    """The ``X-Request-Id`` header of a request, if it has a usable one."""
    value = dict(scope.get("headers", [])).get(REQUEST_ID)
    if value is None or not value.strip() or len(value) > MAX_REQUEST_ID:
        return None
    return value.strip()


def add_cors(app: FastAPI, origins: tuple[str, ...] | None) -> None:
    """Answer browsers from ``origins`` (``*``: any) with CORS headers; none: no CORS."""
    if origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(origins),
                           allow_methods=["*"], allow_headers=["*"],
                           expose_headers=["X-Request-Id"])
