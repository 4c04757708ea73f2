"""Structured outputs over HTTP with the real openai client: ``parse`` with a pydantic model, 50
requests over 10 schemas that all validate (both KV modes, n=2, preemption), and 400s."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field
from serving import client_of, serve
from structured_schemas import SCHEMAS, prompt_for
from test_server import MODEL, Running, metrics, wait_idle

from vmkv.config import EngineConfig
from vmkv.engine.llm_engine import LLMEngine
from vmkv.structured import StructuredOutputsParams

pytestmark = pytest.mark.usefixtures("default_model")

#: KV for ~12 sequences of ~110 tokens (46,080 bytes per token in float32): 100 sequences
#: (50 requests, n=2) cannot all run at once, so some are preempted and recomputed
TIGHT_KV = 12 * 110 * 46080


@pytest.fixture(scope="module", params=["virtual", "paged"])
def tight(request: pytest.FixtureRequest) -> Iterator[Running]:
    yield from serve(EngineConfig(kv_mode=request.param, max_model_len=256, max_num_seqs=64,
                                  kv_cache_memory=TIGHT_KV))


def test_50_requests_over_10_schemas_all_validate(tight: Running) -> None:
    client = client_of(tight)

    def ask(i: int) -> tuple[dict, list]:
        what, schema = SCHEMAS[i % len(SCHEMAS)]
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt_for(what)}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": f"s{i % 10}", "schema": schema,
                                             "strict": True}},
            n=2, temperature=0.7, seed=i, max_tokens=120)
        return schema, r.choices

    with ThreadPoolExecutor(50) as pool:
        results = list(pool.map(ask, range(50)))
    cut = []  # sampled outputs the cap ended (legal whitespace runs can outlast 120 tokens)
    for schema, choices in results:
        assert len(choices) == 2
        for choice in choices:
            if choice.finish_reason == "length":
                cut.append((schema, choice.message.content))
                continue
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), schema)
    assert len(cut) <= 5, cut

    def prefixes_of_documents(engine: LLMEngine) -> list[bool]:  # each cut text can go on
        return [(m := engine.grammars.new_state(StructuredOutputsParams(json=schema)).matcher)
                .accept_string(text) and not m.is_terminated() for schema, text in cut]

    assert all(asyncio.run(tight.engine.call(prefixes_of_documents))), cut
    after = wait_idle(tight.url)
    assert after["vllm:num_preemptions_total"] > 0
    assert after["vmkv:kv_physical_bytes_in_use"] == 0

    def check(engine: LLMEngine) -> None:
        engine.kv.accounting.check()
        assert engine.kv.accounting.usage.bytes_in_use == 0 and not engine.requests

    asyncio.run(tight.engine.call(check))  # on the engine thread, between steps


class Address(BaseModel):
    city: str = Field(max_length=16)
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)
    address: Address


def test_parse_returns_pydantic_objects(tight: Running) -> None:
    client = client_of(tight)
    for seed in range(3):
        r = client.chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": "Describe a person as JSON."}],
            response_format=Person, temperature=0.7, seed=seed, max_tokens=120)
        person = r.choices[0].message.parsed
        assert isinstance(person, Person) and isinstance(person.address, Address)


def test_completions_regex_choice_grammar_and_old_names(tight: Running) -> None:
    client = client_of(tight)
    r = client.completions.create(model=MODEL, prompt="My phone number is", max_tokens=20,
                                  extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert r.choices[0].finish_reason == "stop"
    assert len(r.choices[0].text) == 8 and r.choices[0].text[3] == "-"
    r = client.completions.create(model=MODEL, prompt="Is the sky blue?", max_tokens=5,
                                  extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no")
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A or B?"}], max_tokens=5,
        extra_body={"structured_outputs": {"grammar": 'root ::= "A" | "B"'}}, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in r if c.choices) in ("A", "B")
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a person."}],
        max_tokens=120,
        temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                 "schema": {"type": "foo"}}}},
     "response_format", "Unsupported type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema", "'schema'"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "unsupported"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "number", "multipleOf": 3}}}},
     "response_format", "'multipleOf'"),
    ({"structured_outputs": {"regex": "(oops"}}, "structured_outputs", "invalid"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs", "regexp"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "at most one"),
])
def test_bad_constraints_are_400s_and_the_server_stays_up(tight: Running, body: dict,
                                                          param: str, message: str) -> None:
    r = httpx.post(f"{tight.url}/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"]
    assert httpx.get(f"{tight.url}/health").status_code == 200
    assert metrics(tight.url)["vllm:num_requests_waiting"] == 0
