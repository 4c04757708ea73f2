"""``--api-key``: every route that does work needs ``Authorization: Bearer <key>``, with one
of the keys given (several: each client or team its own, as vLLM takes them).

Open, because they do no work on anyone's behalf and probes or scrapers must reach them without
a secret: ``/health`` and ``/ping`` (liveness and drain state), ``/version``, ``/metrics``
(Prometheus; it reads the engine's counters at most once at a time, see
vmkv/server/metrics.py) and the OpenAPI description (``/openapi.json``, ``/docs``,
``/redoc``). Everything else, including routes added later, is closed: ``/v1/*``,
``/invocations``, ``/tokenize``, ``/detokenize``, ``/reset_prefix_cache``.

The scheme is matched case-insensitively (RFC 9110: ``bearer`` and ``BEARER`` are ``Bearer``),
the key with :func:`hmac.compare_digest`. Pure ASGI rather than ``@app.middleware``: Starlette's
BaseHTTPMiddleware wraps the receive channel and hides client disconnects from the endpoints.
"""

from __future__ import annotations

import hmac
from typing import Any

from vmkv.server.errors import error_response

OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics", "/openapi.json", "/docs",
                        "/docs/oauth2-redirect", "/redoc"})


def bearer_token(header: bytes) -> bytes | None:
    """The credentials of an ``Authorization: Bearer <token>`` header, any case of the scheme."""
    scheme, _, token = header.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return token.strip() or None


class ApiKey:
    """ASGI middleware: requests to closed paths without one of the keys get 401."""

    def __init__(self, app: Any, keys: tuple[str, ...]) -> None:
        self.app, self.expected = app, [key.encode() for key in keys]

    def _known(self, token: bytes) -> bool:
        # every key compared, in constant time each: which key matched is not timed either
        return sum(hmac.compare_digest(token, key) for key in self.expected) > 0

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            token = bearer_token(dict(scope["headers"]).get(b"authorization", b""))
            if token is None or not self._known(token):
                response = error_response(401, "invalid or missing API key")
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)
