"""OpenAPI descriptions for request bodies the app parses itself (vmkv/server/workers.py).

FastAPI documents a body only when it parses it, on the event loop. The routes read the raw
body instead, so each one names its model with ``openapi_extra=request_body(Model)`` and
:func:`install_request_schemas` adds the models (and the models they use) to the components,
so clients and schemathesis see the same schema as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

REF = "#/components/schemas/{model}"


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route whose JSON body is ``model``."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": REF.format(model=model.__name__)}}}}}


def install_request_schemas(app: FastAPI, models: Sequence[type[BaseModel]]) -> None:
    """Add ``models``' JSON schemas to ``app``'s OpenAPI components."""
    build: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()  # cached by FastAPI in app.openapi_schema, extended in place
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                body = model.model_json_schema(ref_template=REF)
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
