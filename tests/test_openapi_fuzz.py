"""A bounded schemathesis run over the server's own OpenAPI description: bodies generated from
the schema (valid and invalid, boundary values, wrong types) against a real server on
127.0.0.1. No input may produce a 5xx. 25 examples per operation and generation mode, a few
hundred requests in all; a context of 24 tokens keeps every accepted generation short."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from test_server import Running, start

from vmkv.config import EngineConfig
from vmkv.engine.async_engine import AsyncEngine
from vmkv.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.usefixtures("default_model")
EXAMPLES = 25  # per operation and mode: ~300 requests in all


@pytest.fixture(scope="module")
def fuzzed() -> Iterator[Running]:
    llm = LLMEngine(EngineConfig(max_model_len=24, max_num_seqs=16, kv_cache_memory=64 << 20))
    engine = AsyncEngine(llm)
    running = start(engine)
    yield running
    running.stop()
    engine.shutdown()
    llm.close()


def operations(url: str) -> list[schemathesis.APIOperation]:
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("mode", list(schemathesis.GenerationMode))
def test_no_generated_input_gets_a_server_error(fuzzed: Running,
                                                mode: schemathesis.GenerationMode) -> None:
    """Every operation, bodies from its schema (positive: valid ones, negative: violations)."""
    ops = operations(fuzzed.url)
    assert {op.path for op in ops} >= {"/v1/completions", "/v1/chat/completions",
                                        "/v1/responses", "/tokenize", "/detokenize", "/health",
                                        "/metrics"}
    for op in ops:
        if mode is schemathesis.GenerationMode.NEGATIVE and not op.body:
            continue  # no body, no parameters: nothing to violate
        @given(case=op.as_strategy(mode))
        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def call(case: schemathesis.Case) -> None:
            case.call_and_validate(base_url=fuzzed.url, checks=[not_a_server_error],
                                   timeout=60)

        call()
    assert fuzzed.engine.is_alive and httpx.get(f"{fuzzed.url}/health").status_code == 200
