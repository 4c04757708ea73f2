"""Structured outputs at the HTTP edge: ``response_format``, ``structured_outputs`` and vLLM's
older ``guided_*`` fields become one :class:`StructuredOutputsParams`, compiled off the event
loop before the request reaches the engine (a bad schema is a 400 and nothing is queued)."""

from __future__ import annotations

import asyncio
from typing import Any

from vmkv.server.errors import APIError
from vmkv.structured import StructuredOutputsParams

#: vLLM's pre-0.10 names, still sent by older clients
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def requested_structure(body: Any) -> tuple[str, StructuredOutputsParams] | None:
    """The one output constraint a request body asks for, with the field that asks (None:
    none); APIError(400) when the fields are malformed or more than one is given."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    fmt = getattr(body, "response_format", None)
    if fmt is not None:
        params = _from_response_format(fmt)
        if params is not None:
            found.append(("response_format", params))
    if getattr(body, "structured_outputs", None) is not None:
        found.append(("structured_outputs",
                      _build("structured_outputs", StructuredOutputsParams.from_dict,
                             body.structured_outputs)))
    for name, kind in _GUIDED.items():
        value = getattr(body, name, None)
        if value is not None:
            found.append((name, _build(name, lambda v, k=kind: StructuredOutputsParams(**{k: v}),
                                       value)))
    if len(found) > 1:
        raise APIError(400, "give at most one of response_format (json_object / json_schema), "
                       f"structured_outputs and guided_*; got {[n for n, _ in found]}",
                       found[1][0])
    return found[0] if found else None


async def compile_structure(front: Any, params: StructuredOutputsParams, param: str) -> None:
    """Compile (and cache) the grammar in a worker thread; APIError(400) if it is refused."""
    try:
        await asyncio.to_thread(front.grammars.compile, params)
    except ValueError as exc:
        raise APIError(400, str(exc), param) from None


def _from_response_format(fmt: Any) -> StructuredOutputsParams | None:
    if not isinstance(fmt, dict):
        raise APIError(400, "response_format must be an object", "response_format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise APIError(400, "response_format.json_schema must be an object with a "
                           "'schema'", "response_format.json_schema")
        return _build("response_format.json_schema.schema",
                      lambda s: StructuredOutputsParams(json=s), spec["schema"])
    raise APIError(400, f"unsupported response_format type {kind!r}; use text, json_object or "
                   "json_schema", "response_format.type")


def _build(param: str, make: Any, value: Any) -> StructuredOutputsParams:
    try:
        return make(value)
    except (TypeError, ValueError) as exc:
        raise APIError(400, str(exc), param) from None


async def prepare_structure(front: Any, body: Any,
                            forced: StructuredOutputsParams | None = None,
                            sent_as: dict[str, str] | None = None
                            ) -> StructuredOutputsParams | None:
    """The request's output constraint, compiled: ``forced`` (tool_choice required / named)
    or the one the body asks for; APIError(400) if both are given or it does not compile,
    naming the field the client used (``sent_as``: a body field's name in the client's
    request, e.g. Responses' ``text.format`` for ``response_format``)."""
    requested = requested_structure(body)
    if forced is not None and requested is not None:
        raise APIError(400, "tool_choice 'required' or a named function already constrains the "
                       "output; drop response_format / structured_outputs", "tool_choice")
    if forced is not None:
        param, params = "tool_choice", forced
    elif requested is not None:
        param, params = requested
    else:
        return None
    await compile_structure(front, params, (sent_as or {}).get(param, param))
    return params
