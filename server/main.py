"""Start the server: engine thread + FastAPI app under uvicorn."""

from __future__ import annotations

import logging

from vmkv.config import EngineConfig, ServerConfig
from vmkv.engine.async_engine import AsyncEngine
from vmkv.engine.llm_engine import LLMEngine
from vmkv.process_tuning import tune_process
from vmkv.server.app import build_app
from vmkv.server.shutdown import ABORT_GRACE, GracefulServer

logger = logging.getLogger("vmkv.server")


def serve(engine_config: EngineConfig, server_config: ServerConfig | None = None, *,
          log_level: str = "info") -> None:
    """Tune the process, load the model, start the engine loop and serve until SIGTERM or
    SIGINT, then drain on ``server_config.shutdown_timeout`` and release everything.

    OpenMP settings reach torch only if this process has not imported torch yet (``vmkv
    serve`` tunes first thing; see vmkv/process_tuning.py)."""
    import uvicorn

    tune_process()
    config = server_config or ServerConfig()
    engine = LLMEngine(engine_config)
    async_engine = AsyncEngine(engine)
    app = build_app(async_engine, config)
    logger.info("serving %s on http://%s:%d", app.state.metrics.model_name, config.host,
                config.port)
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level,
                               timeout_graceful_shutdown=ABORT_GRACE)
    try:  # SIGTERM/SIGINT drain on the deadline, then return (vmkv/server/shutdown.py)
        GracefulServer(uv_config, app.state.lifecycle, config.shutdown_timeout).run()
    finally:
        app.state.workers.close()
        async_engine.shutdown()
        engine.close()  # every page and the pool's memory back to the OS
