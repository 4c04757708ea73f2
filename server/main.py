"""Start the server: engine thread + FastAPI app under uvicorn."""

from __future__ import annotations

import logging

from server.app import ServerConfig, build_app
from vmkv.engine.async_engine import AsyncEngine
from vmkv.engine.config import EngineConfig
from vmkv.engine.llm_engine import LLMEngine

logger = logging.getLogger("vmkv.server")


def _default_name(model: str | None) -> str:
    from pathlib import Path

    from vmkv.models.default_model import DEFAULT_MODEL, is_default_name

    return DEFAULT_MODEL if is_default_name(model) else Path(model).name


def serve(engine_config: EngineConfig, *, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, served_model_name: str | None = None,
          max_body_bytes: int = 4 << 20, log_level: str = "info") -> None:
    """Load the model, start the engine loop and serve until interrupted."""
    import uvicorn

    engine = LLMEngine(engine_config)
    name = served_model_name or _default_name(engine_config.model)
    async_engine = AsyncEngine(engine)
    app = build_app(async_engine, ServerConfig(served_model_name=name, api_key=api_key,
                                               max_body_bytes=max_body_bytes))
    logger.info("serving %s on http://%s:%d", name, host, port)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    finally:
        async_engine.shutdown()
        engine.close()
