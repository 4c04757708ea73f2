"""Whole (non-streamed) response bodies, built and serialised off the event loop.

A response with ``top_logprobs: 20`` over 4,096 tokens is ~90,000 small dicts and ~10 MB of
JSON: built and dumped on the loop it held ``/health`` for about a second. :func:`json_response`
runs the building function in a thread and serialises its result in pieces (each element of a
long list on its own), so the loop gets the GIL back between pieces (Python switches threads
every 5 ms; one ``json.dumps`` of the whole body is a single C call that never lets go).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from fastapi.responses import Response

#: lists longer than this are serialised element by element
PIECEWISE = 64


def dumps(obj: Any) -> str:
    """``json.dumps(obj)`` (compact, UTF-8 kept), built from small dumps calls."""
    if isinstance(obj, dict):
        return "{" + ",".join(f"{_plain(str(k))}:{dumps(v)}" for k, v in obj.items()) + "}"
    if isinstance(obj, list):
        pieces = map(_plain, obj) if len(obj) > PIECEWISE else map(dumps, obj)
        return "[" + ",".join(pieces) + "]"
    return _plain(obj)


def _plain(obj: Any) -> str:
    if isinstance(obj, list | dict) and len(obj) > PIECEWISE:
        return dumps(obj)
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


async def json_response(build: Callable[[], dict[str, Any]],
                        headers: dict[str, str] | None = None) -> Response:
    """A JSON response whose body ``build()`` makes, built and serialised in a thread."""
    body = await asyncio.to_thread(lambda: dumps(build()).encode())
    return Response(body, media_type="application/json", headers=headers)
