"""``POST /invocations``: SageMaker's one inference route, as vLLM serves it. The body is a chat
completion when it has ``messages``, a completion when it has ``prompt``; the route answers
exactly as ``/v1/chat/completions`` or ``/v1/completions`` would (streaming included)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from vmkv.server.errors import APIError
from vmkv.server.protocol import RequestModel
from vmkv.server.session import ServingSession

Route = Callable[[Request], Awaitable[Response]]


class _Kind(RequestModel):
    """Only what tells the endpoints apart (the rest stays in ``model_extra``, unread)."""

    messages: Any = None
    prompt: Any = None


class InvocationsHandler:
    """Serves ``POST /invocations`` by handing the request to the chat or the completions
    route (``create`` is the route; no docstring: it would become the OpenAPI description)."""

    def __init__(self, session: ServingSession, chat: Route, completions: Route) -> None:
        self.session, self.chat, self.completions = session, chat, completions

    async def create(self, raw: Request) -> Response:
        # parsed off the loop when large, with the input limits; the route parses it again
        kind = await self.session.workers.parse(await raw.body(), _Kind)
        if kind.messages is not None:
            return await self.chat(raw)
        if kind.prompt is not None:
            return await self.completions(raw)
        raise APIError(400, "an /invocations body needs messages (a chat completion) or prompt "
                       "(a completion)")
