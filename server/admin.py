"""The routes that generate nothing: ``GET /health`` (``/ping``), ``/version``, ``/v1/models``,
``/metrics``, and the development route ``POST /reset_prefix_cache`` (served only with
``ServerConfig.dev_mode``, as vLLM's with ``VLLM_SERVER_DEV_MODE=1``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

import vmkv
from vmkv.config import ServerConfig
from vmkv.engine.front import ServingEngine
from vmkv.engine.llm_engine import LLMEngine
from vmkv.kernels import cpu_kernels
from vmkv.models.default_model import DEFAULT_MODEL, is_default_name
from vmkv.server.errors import RETRY_AFTER, error_response
from vmkv.server.metrics import Metrics
from vmkv.server.shutdown import Lifecycle


def served_name(model: str | None) -> str:
    """The name a model is served under when none is given: its folder's (or file's) name."""
    return DEFAULT_MODEL if is_default_name(model) else Path(model).name


class AdminHandler:
    """Health, version, the model list, Prometheus metrics and the development routes.

    Its methods are the routes (their docstrings would become OpenAPI descriptions, so they
    have none): ``health`` (and SageMaker's ``ping``) 200 while the engine lives, 503 once it
    died or (+ Retry-After) while draining; ``models`` one entry per served name, whose
    ``root`` is the model's name, never a local path; ``metrics_endpoint`` the Prometheus text
    with the engine's numbers refreshed (server/metrics.py); ``reset_prefix_cache`` forgets
    every cached prefix unit in every replica (running requests keep their KV).
    """

    def __init__(self, engine: ServingEngine, config: ServerConfig, metrics: Metrics,
                 lifecycle: Lifecycle) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.lifecycle = lifecycle
        # which C++ kernels a CPU engine runs (a library that failed to build: what runs
        # instead)
        self.health_body: dict[str, Any] = {"status": "ok"}
        if engine.front.config.device == "cpu":
            self.health_body["cpu_kernels"] = cpu_kernels.status()

    async def health(self) -> Response:
        if not self.engine.is_alive:
            return error_response(503, f"the engine loop died: {self.engine.dead!r}")
        if self.lifecycle.draining:
            return error_response(503, "draining: the server is shutting down",
                                  headers=RETRY_AFTER)
        return JSONResponse(self.health_body)

    async def ping(self) -> Response:
        return await self.health()

    async def version(self) -> dict:
        return {"version": vmkv.__version__}

    async def models(self) -> dict:
        front = self.engine.front
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": int(time.time()),
            "owned_by": "vmkv", "root": served_name(front.config.model),
            "max_model_len": front.max_model_len,
        } for name in self.config.served_model_name]}

    async def metrics_endpoint(self) -> Response:
        await self.metrics.refresh(self.engine)
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def reset_prefix_cache(self) -> dict:
        dropped = sum(await self.engine.call_all(LLMEngine.reset_prefix_cache))
        return {"dropped_units": dropped}
