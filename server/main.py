"""Start the server: the engine (a thread, or data-parallel replica processes) + the FastAPI
app under uvicorn."""

from __future__ import annotations

import logging
from collections.abc import Callable

from vmkv.config import EngineConfig, ServerConfig
from vmkv.engine.async_engine import AsyncEngine
from vmkv.engine.front import ServingEngine
from vmkv.engine.llm_engine import LLMEngine
from vmkv.process_tuning import tune_process
from vmkv.server.app import build_app
from vmkv.server.shutdown import ABORT_GRACE, GracefulServer

logger = logging.getLogger("vmkv.server")


def start_engine(config: EngineConfig) -> tuple[ServingEngine, Callable[[], None]]:
    """The serving engine ``config`` asks for, running, and the function that stops it and
    releases its memory: one in-process engine thread, or ``data_parallel_size`` replica
    processes (vmkv/engine/data_parallel.py)."""
    if config.data_parallel_size > 1:
        from vmkv.engine.data_parallel import DataParallelEngine

        replicas = DataParallelEngine(config)
        return replicas, replicas.shutdown
    engine = AsyncEngine(LLMEngine(config))

    def close() -> None:
        # the engine thread closes the engine as it ends (every page and the pool's memory
        # back to the OS): never under a step it is still running
        engine.shutdown(close_engine=True)

    return engine, close


def serve(engine_config: EngineConfig, server_config: ServerConfig | None = None, *,
          log_level: str = "info") -> None:
    """Tune the process, load the model, start the engine loop and serve until SIGTERM or
    SIGINT, then drain on ``server_config.shutdown_timeout`` and release everything.

    OpenMP settings reach torch only if this process has not imported torch yet (``vmkv
    serve`` tunes first thing; see vmkv/process_tuning.py)."""
    import uvicorn

    tune_process()
    config = server_config or ServerConfig()
    engine, close_engine = start_engine(engine_config)
    app = build_app(engine, config)
    logger.info("serving %s on http://%s:%d", app.state.metrics.model_name, config.host,
                config.port)
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level,
                               timeout_graceful_shutdown=ABORT_GRACE)
    try:  # SIGTERM/SIGINT drain on the deadline, then return (vmkv/server/shutdown.py)
        GracefulServer(uv_config, app.state.lifecycle, config.shutdown_timeout).run()
    finally:
        app.state.workers.close()
        close_engine()
