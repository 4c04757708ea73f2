"""POST /v1/responses through the real openai client, unchanged (client.responses.create,
.parse and .stream), in both KV modes: plain text, streamed with OpenAI's event sequence, a
function tool and its round trip, a JSON schema; and the stateful options refused."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from serving import client_of, serve
from test_server import MODEL, Running, wait_idle

from vmkv.config import EngineConfig

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 16},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather now",
        "parameters": WEATHER}
ASK = "What is the weather in Paris?"


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module", params=["virtual", "paged"])
def srv(request: pytest.FixtureRequest, default_model: object) -> Iterator[Running]:
    yield from serve(EngineConfig(kv_mode=request.param, max_model_len=384, max_num_seqs=8))


@pytest.fixture(scope="module")
def client(srv: Running) -> openai.OpenAI:
    return client_of(srv)


def test_plain_text(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="Tell me a long story.", temperature=0,
                                max_output_tokens=8, instructions="You are a storyteller.")
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant"
    assert r.output_text and r.output_text == message.content[0].text
    assert r.usage.output_tokens == 8
    assert r.usage.total_tokens == r.usage.input_tokens + 8
    # the same conversation as messages with content parts gives the same greedy text
    again = client.responses.create(model=MODEL, max_output_tokens=8, temperature=0, input=[
        {"role": "developer", "content": "You are a storyteller."},
        {"role": "user", "content": [{"type": "input_text", "text": "Tell me a long story."}]}])
    assert again.output_text == r.output_text


def test_streamed_with_the_documented_event_sequence(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model=MODEL, input="Tell me a long story.",
                                          max_output_tokens=6, temperature=0, stream=True,
                                          top_logprobs=2))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added",
                     *["response.output_text.delta"] * deltas, "response.output_text.done",
                     "response.content_part.done", "response.output_item.done",
                     "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = events[-1].response
    assert text == done.output_text and done.usage.output_tokens == 6
    assert len(done.output[0].content[0].logprobs) == 6
    assert all(len(lp.top_logprobs) == 2 for lp in done.output[0].content[0].logprobs)
    plain = client.responses.create(model=MODEL, input="Tell me a long story.", temperature=0,
                                    max_output_tokens=6)
    assert plain.output_text == text


def test_a_json_schema_through_parse_and_stream(client: openai.OpenAI) -> None:
    r = client.responses.parse(model=MODEL, input="Describe a person.", text_format=Person,
                               max_output_tokens=80, temperature=0.7)
    assert r.status == "completed" and isinstance(r.output_parsed, Person)
    with client.responses.stream(model=MODEL, input="Describe a person.", text_format=Person,
                                 max_output_tokens=80, temperature=0.7) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert isinstance(final.output_parsed, Person)
    raw = client.responses.create(model=MODEL, input="Describe a person.", temperature=0,
                                  max_output_tokens=80, text={"format": {
                                      "type": "json_schema", "name": "person",
                                      "schema": Person.model_json_schema(), "strict": True}})
    Person.model_validate_json(raw.output_text)


def test_a_function_tool_and_its_round_trip(client: openai.OpenAI) -> None:
    for choice in ({"type": "function", "name": "get_weather"}, "required"):
        r = client.responses.create(model=MODEL, input=ASK, tools=[TOOL], tool_choice=choice,
                                    max_output_tokens=80, temperature=0.7,
                                    parallel_tool_calls=False, extra_body={"seed": 1})
        assert r.status == "completed"
        (call,) = r.output
        assert call.type == "function_call" and call.name == "get_weather"
        assert call.call_id.startswith("call_") and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), WEATHER)
    with client.responses.stream(model=MODEL, input=ASK, tools=[TOOL], temperature=0.7,
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 max_output_tokens=80, extra_body={"seed": 1}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:3] == ["response.created", "response.in_progress",
                         "response.output_item.added"]
    assert "response.function_call_arguments.delta" in kinds
    assert kinds[-3:] == ["response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]
    (streamed,) = final.output
    jsonschema.validate(json.loads(streamed.arguments), WEATHER)
    # the call and its output go back as input items, and the model answers in text
    answer = client.responses.create(model=MODEL, tools=[TOOL], tool_choice="none",
                                     max_output_tokens=10, temperature=0, input=[
                                         {"role": "user", "content": ASK},
                                         {"type": "function_call", "call_id": call.call_id,
                                          "name": call.name, "arguments": call.arguments},
                                         {"type": "function_call_output",
                                          "call_id": call.call_id,
                                          "output": '{"temperature": 21}'}])
    assert answer.output[0].type == "message" and answer.output_text


@pytest.mark.parametrize(("body", "param", "text"), [
    ({"store": True}, "store", "stateless"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "stateless"),
    ({"background": True}, "background", "stateless"),
    ({"conversation": "conv_1"}, "conversation", "stateless"),
    ({"tools": [{"type": "web_search"}]}, "tools.0", "function tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0.type", "text only"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input.0.type",
     "not supported"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning", "reasoning.effort"),
    ({"include": ["file_search_call.results"]}, "include", "can be included"),
    ({"text": {"verbosity": "low"}}, "text", "text.verbosity"),
    ({"text": {"format": {"type": "json_schema", "name": "x",
                          "schema": {"type": "array", "uniqueItems": True}}}},
     "text.format", "'uniqueItems'"),
    ({"tools": [TOOL]}, "tool_choice", "'auto' needs a chat template"),  # SmolLM2 has none
])
def test_what_a_stateless_server_cannot_do_is_a_clear_400(srv: Running, body: dict,
                                                          param: str, text: str) -> None:
    r = httpx.post(f"{srv.url}/v1/responses", json={"model": MODEL, "input": ASK, **body},
                   timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and text in error["message"], error


def test_nothing_is_held_after(srv: Running) -> None:
    assert wait_idle(srv.url)["vmkv:kv_physical_bytes_in_use"] == 0
