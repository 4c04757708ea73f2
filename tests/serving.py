"""A server on its own engine for the serving-feature tests: ``yield from serve(config)`` in a
fixture, and the openai client pointed at it."""

from __future__ import annotations

from collections.abc import Iterator

import openai
from test_server import Running, start

from vmkv.config import EngineConfig
from vmkv.server.main import start_engine


def serve(config: EngineConfig, **server: object) -> Iterator[Running]:
    """Build the engine (replica processes when ``config.data_parallel_size > 1``), serve it
    on 127.0.0.1, and tear both down when resumed."""
    engine, close = start_engine(config)
    running = start(engine, **server)
    yield running
    running.stop()
    close()


def client_of(running: Running, timeout: float = 600) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0,
                         timeout=timeout)
