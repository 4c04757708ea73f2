"""Whole (non-streamed) response bodies, built and serialised off the event loop.

A response with ``top_logprobs: 20`` over 4,096 tokens is ~90,000 small dicts and ~10 MB of
JSON: built and dumped on the loop it held ``/health`` for about a second. :func:`json_response`
runs the building function on a body thread (server/workers.py) and serialises its result in
pieces (each element of a long list on its own), so the loop gets the GIL back between pieces
(Python switches threads every 5 ms; one ``json.dumps`` of the whole body is a single C call
that never lets go).

A thread is not enough on its own: the ~250,000 containers such a body creates trigger the
cyclic garbage collector's full collections, each a stop-the-world walk of every object in the
process (measured: 170-220 ms with the model loaded). So the collector pauses while a body is
built (:func:`gc_paused`; the body's objects are freed by reference counting, none is cyclic),
and the server moves the objects alive at start-up out of its reach (``gc.freeze()``, as vLLM
does), so the collections that do run walk only what requests created.
"""

from __future__ import annotations

import contextlib
import gc
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from fastapi.responses import Response

if TYPE_CHECKING:
    from vmkv.server.workers import Workers

#: lists longer than this are serialised element by element
PIECEWISE = 64
#: elements serialised between two offers of the GIL to the loop (~1 ms of logprob entries)
YIELD_EVERY = 16


def dumps(obj: Any) -> bytes:
    """``json.dumps(obj).encode()`` (compact, UTF-8 kept), written in small pieces that are
    joined once: long lists item by item, and an iterator as an array whose items are made one
    at a time, each serialised and freed before the next (freeing ~90,000 dicts at once is
    itself a 25 ms C call). Pieces are bytes: one text of mixed scripts is stored 4 bytes a
    character, and copying or encoding 30 MB of it is a C call of tens of milliseconds."""
    parts: list[bytes] = []
    _write(obj, parts)
    return b"".join(parts)


def _write(obj: Any, out: list[bytes]) -> None:
    if isinstance(obj, dict):
        out.append(b"{")
        for i, (key, value) in enumerate(obj.items()):
            out.append(b"," + _plain(str(key)) + b":" if i else _plain(str(key)) + b":")
            _write(value, out)
        out.append(b"}")
    elif isinstance(obj, list) and len(obj) <= PIECEWISE:
        out.append(b"[")
        for i, item in enumerate(obj):
            if i:
                out.append(b",")
            _write(item, out)
        out.append(b"]")
    elif isinstance(obj, list | Iterator):
        out.append(b"[")
        for i, item in enumerate(obj):
            if i % YIELD_EVERY == 0:  # the loop, if it waits for the GIL, gets it now
                time.sleep(0)         # rather than after Python's 5 ms switch interval
            out.append(b"," + _plain(item) if i else _plain(item))
        out.append(b"]")
    else:
        out.append(_plain(obj))


def _plain(obj: Any) -> bytes:
    if isinstance(obj, list | dict) and len(obj) > PIECEWISE:
        return dumps(obj)
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def sse_event(payload: dict[str, Any]) -> bytes:
    """One server-sent event, serialised by :func:`dumps` (iterators allowed)."""
    return b"data: " + dumps(payload) + b"\n\n"


_pauses = 0
_pauses_lock = threading.Lock()


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection in the process while any thread is inside."""
    global _pauses
    with _pauses_lock:
        _pauses += 1
        gc.disable()
    try:
        yield
    finally:
        with _pauses_lock:
            _pauses -= 1
            if not _pauses:
                gc.enable()


def _build_bytes(build: Callable[[], dict[str, Any]]) -> bytes:
    with gc_paused():
        return dumps(build())  # the body's objects are freed before the collector runs


async def json_response(workers: Workers, build: Callable[[], dict[str, Any]],
                        headers: dict[str, str] | None = None) -> Response:
    """A JSON response whose body ``build()`` makes, built and serialised on one of the
    server's body threads (:meth:`~vmkv.server.workers.Workers.build`)."""
    body = await workers.build(_build_bytes, build)
    return Response(body, media_type="application/json", headers=headers)
