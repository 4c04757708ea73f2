"""Where vmkv's API now behaves as vLLM's (issue 57): each test failed on 2b6f1fc's behaviour.
A real server on 127.0.0.1 (two apps over one engine: the defaults, and one with the new flags),
httpx and the real openai client; the Responses event writer directly for the stream shapes a
small model cannot be made to produce on demand."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace

import httpx
import pytest
from test_server import MODEL, Running, start

from vmkv.config import EngineConfig
from vmkv.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from vmkv.sampling_params import SamplingParams
from vmkv.server import responses as R
from vmkv.server.errors import APIError
from vmkv.server.main import start_engine
from vmkv.server.responses_output import EventWriter, ResponseShape, stream_events
from vmkv.server.responses_request import ResponsesRequest
from vmkv.server.tools import plan_tools

pytestmark = pytest.mark.usefixtures("default_model")
MAX_LEN = 256
KEYS = ("first-key", "second-key")
TEMPLATE = ("{{ greeting }}|{% for m in messages %}{{ m.role }}:{{ m.content }}|{% endfor %}"
            "{% if add_generation_prompt %}bot:{% endif %}")


@pytest.fixture(scope="module")
def engine() -> Iterator[object]:
    engine, close = start_engine(EngineConfig(max_model_len=MAX_LEN))
    yield engine
    close()


@pytest.fixture(scope="module")
def srv(engine: object) -> Iterator[Running]:
    running = start(engine)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def flagged(engine: object) -> Iterator[Running]:
    """The same engine behind the new flags."""
    running = start(engine, api_key=KEYS, enable_force_include_usage=True,
                    default_chat_template_kwargs='{"greeting": "hello"}', response_role="bot",
                    chat_template=TEMPLATE)
    yield running
    running.stop()


def post(url: str, path: str, body: dict, **kw: object) -> httpx.Response:
    return httpx.post(f"{url}{path}", json={"model": MODEL, **body}, timeout=120, **kw)


def sse(response: httpx.Response) -> list[dict]:
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    return [json.loads(x) for x in lines if x != "[DONE]"]


CHAT = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 4,
        "temperature": 0}


# -- request semantics ----------------------------------------------------------------------------
@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
                                       ("/v1/chat/completions", CHAT)])
def test_prompt_logprobs_with_a_stream_is_refused(srv: Running, path: str, body: dict) -> None:
    r = post(srv.url, path, {**body, "stream": True, "prompt_logprobs": 1})
    assert r.status_code == 400 and "prompt_logprobs" in r.json()["error"]["message"]


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
                                       ("/v1/chat/completions", CHAT)])
def test_stream_options_without_a_stream_are_refused(srv: Running, path: str,
                                                     body: dict) -> None:
    options = {"stream_options": {"include_usage": True}}
    r = post(srv.url, path, {**body, **options})
    assert r.status_code == 400 and "stream_options" in r.json()["error"]["message"]
    assert post(srv.url, path, {**body, **options, "stream": True}).status_code == 200


def test_explicit_nulls_mean_the_defaults(srv: Running) -> None:
    nulls = {"n": None, "stream": None, "logprobs": None, "echo": None}
    r = post(srv.url, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, **nulls})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["choices"][0]["logprobs"] is None
    r = post(srv.url, "/v1/chat/completions", {**CHAT, **nulls, "parallel_tool_calls": None})
    assert r.status_code == 200, r.text
    r = post(srv.url, "/v1/responses", {"input": "Hi", "max_output_tokens": 2, "stream": None,
                                        "parallel_tool_calls": None})
    assert r.status_code == 200, r.text


def test_chat_echo_goes_on_from_a_last_message_with_the_replys_role(srv: Running) -> None:
    # no generation prompt: the reply continues the user's message, so it has its role
    body = {"messages": [{"role": "user", "content": "The capital of France"}],
            "add_generation_prompt": False, "echo": True, "max_tokens": 3, "temperature": 0}
    r = post(srv.url, "/v1/chat/completions", body).json()
    message = r["choices"][0]["message"]
    assert message["role"] == "user"
    assert message["content"].startswith("The capital of France")
    assert r["prompt_logprobs"][0] is None and len(r["prompt_logprobs"]) > 3  # vLLM: echo
    plain = post(srv.url, "/v1/chat/completions", {**CHAT, "echo": True}).json()
    assert plain["choices"][0]["message"]["role"] == "assistant"  # a user's last message is
    assert not plain["choices"][0]["message"]["content"].startswith("Name a colour")  # not echoed


def test_concurrent_requests_may_share_an_x_request_id(srv: Running) -> None:
    headers = {"X-Request-Id": "shared-id"}
    with httpx.stream("POST", f"{srv.url}/v1/completions", headers=headers, timeout=120,
                      json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 40,
                            "stream": True, "ignore_eos": True}) as first:
        lines = first.iter_lines()
        assert next(lines).startswith("data: ")  # the first request is running
        second = post(srv.url, "/v1/completions", {"prompt": "Hi", "max_tokens": 2},
                      headers=headers)
        rest = list(lines)
    assert second.status_code == 200, second.text
    assert second.json()["id"] == "cmpl-shared-id"
    assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]"


def test_tokenize_takes_a_conversation_of_exactly_max_model_len_tokens(srv: Running) -> None:
    def count(words: int) -> httpx.Response:
        messages = [{"role": "user", "content": "a" + " a" * words}]
        return post(srv.url, "/tokenize", {"messages": messages})

    base = count(0).json()["count"]
    words = MAX_LEN - base
    while count(words).status_code == 200 and count(words).json()["count"] < MAX_LEN:
        words += 1
    exact = count(words)
    assert exact.status_code == 200 and exact.json()["count"] == MAX_LEN
    over = count(words + 1)
    assert over.status_code == 400 and over.json()["error"]["param"] == "messages"


@pytest.mark.parametrize("field,value", [
    ("guided_regex", "(unclosed"),
    ("structured_outputs", {"regex": "(unclosed"}),
    ("response_format", {"type": "json_schema",
                         "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
])
def test_a_structure_that_does_not_compile_names_the_field_sent(
        srv: Running, field: str, value: object) -> None:
    r = post(srv.url, "/v1/chat/completions", {**CHAT, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].split(".")[0] == field


def test_a_responses_format_that_does_not_compile_names_text_format(srv: Running) -> None:
    fmt = {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}
    r = post(srv.url, "/v1/responses", {"input": "Hi", "text": {"format": fmt}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format", r.text


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 25}),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 2, "top_logprobs": 25}),
])
def test_max_logprobs_names_top_logprobs_when_that_was_sent(srv: Running, path: str,
                                                            body: dict) -> None:
    error = post(srv.url, path, body).json()["error"]
    assert error["param"] == "top_logprobs" and error["message"].startswith("top_logprobs")


# -- the Responses API --------------------------------------------------------------------------
def test_responses_report_the_effective_temperature_and_top_p(srv: Running) -> None:
    r = post(srv.url, "/v1/responses", {"input": "Hi", "max_output_tokens": 2}).json()
    assert r["temperature"] == 1.0 and r["top_p"] == 1.0  # what ran, not null
    r = post(srv.url, "/v1/responses", {"input": "Hi", "max_output_tokens": 2,
                                        "temperature": 0.5, "top_p": 0.9}).json()
    assert (r["temperature"], r["top_p"]) == (0.5, 0.9)


def test_responses_truncation_auto_drops_the_oldest_items(srv: Running) -> None:
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": " ".join(["word"] * 40)}
             for i in range(9)]
    body = {"input": turns, "instructions": "Be brief.", "max_output_tokens": 8}
    refused = post(srv.url, "/v1/responses", body)
    assert refused.status_code == 400, refused.text
    r = post(srv.url, "/v1/responses", {**body, "truncation": "auto"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["truncation"] == "auto"
    assert out["usage"]["input_tokens"] + 8 <= MAX_LEN < 9 * 40


def test_responses_accept_include_reasoning_encrypted_content(srv: Running) -> None:
    r = post(srv.url, "/v1/responses", {"input": "Hi", "max_output_tokens": 2, "store": False,
                                        "include": ["reasoning.encrypted_content"]})
    assert r.status_code == 200, r.text


def _shape(**body: object) -> ResponseShape:
    session = SimpleNamespace(model_name=MODEL, token_text=R.token_id_text)
    request = ResponsesRequest.model_validate({"input": "x", **body})
    return ResponseShape(session, request, "resp_1", plan_tools(None, None, True, None),
                         SamplingParams(temperature=0.7))


def _output(text: str, ids: list[int], finished: bool = True) -> RequestOutput:
    logprobs = [{t: -0.5} for t in ids]
    return RequestOutput("r", None, [1], [CompletionOutput(
        0, text, ids, "stop" if finished else None, None, logprobs)], finished,
        RequestMetrics(0.0))


def _events(chunks: list[str]) -> list[dict]:
    return [json.loads(c.split("data: ", 1)[1]) for c in chunks]


def test_responses_stream_keeps_the_logprobs_of_held_back_text() -> None:
    writer = EventWriter(_shape(top_logprobs=0))
    held = writer.delta({}, [{"token": "a", "logprob": -1.0}])  # text held back: no event
    sent = _events(writer.delta({"content": "ab"}, [{"token": "b", "logprob": -2.0}]))
    assert held == []
    assert [lp["token"] for lp in sent[-1]["logprobs"]] == ["a", "b"]
    done = _events(writer.finish(_output("ab", [5, 6]), "stop"))
    final = done[-1]["response"]["output"][0]["content"][0]
    assert [lp["token"] for lp in final["logprobs"]] == ["a", "b"]


def test_responses_stream_of_an_empty_reply_holds_one_empty_message() -> None:
    shape = _shape()
    writer = EventWriter(shape)
    events = _events(writer.finish(_output("", [2]), "stop"))
    streamed = events[-1]["response"]
    unstreamed = shape.final(_output("", [2]))
    assert [e["type"] for e in events][:2] == ["response.output_item.added",
                                              "response.content_part.added"]
    assert streamed["output"] == unstreamed["output"] != []
    assert streamed["temperature"] == 0.7  # the effective value, streamed too


def test_responses_stream_that_fails_ends_with_response_failed() -> None:
    async def failing(*_: object) -> AsyncIterator[tuple[int, RequestOutput]]:
        yield 0, _output("Hel", [5], finished=False)
        raise APIError(503, "KV cache memory error")

    session = SimpleNamespace(merged=failing)
    shape = _shape()

    async def run() -> list[dict]:
        return _events([e async for e in stream_events(session, shape, [], 0.0)])

    events = asyncio.run(run())
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and "KV cache" in failed["error"]["message"]


# -- flags and routes -----------------------------------------------------------------------------
def test_ping_and_invocations_as_sagemaker_calls_them(srv: Running) -> None:
    assert httpx.get(f"{srv.url}/ping").status_code == 200
    assert httpx.post(f"{srv.url}/ping").status_code == 200
    chat = post(srv.url, "/invocations", CHAT).json()
    assert chat["object"] == "chat.completion"
    text = post(srv.url, "/invocations", {"prompt": "Hi", "max_tokens": 2}).json()
    assert text["object"] == "text_completion"
    assert post(srv.url, "/invocations", {"input": "x"}).status_code == 400


def test_every_api_key_opens_the_api_and_probes_stay_open(flagged: Running) -> None:
    for key in KEYS:
        r = post(flagged.url, "/tokenize", {"prompt": "Hi"},
                 headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
    assert post(flagged.url, "/tokenize", {"prompt": "Hi"},
                headers={"Authorization": "Bearer other"}).status_code == 401
    assert post(flagged.url, "/invocations", CHAT).status_code == 401
    assert httpx.get(f"{flagged.url}/ping").status_code == 200


AUTH = {"Authorization": f"Bearer {KEYS[1]}"}


def test_default_chat_template_kwargs_reach_the_template_unless_the_request_sets_them(
        flagged: Running) -> None:
    def rendered(extra: dict) -> str:
        ids = post(flagged.url, "/tokenize", {"messages": CHAT["messages"], **extra},
                   headers=AUTH).json()["tokens"]
        return post(flagged.url, "/detokenize", {"tokens": ids}, headers=AUTH).json()["prompt"]

    assert rendered({}).startswith("hello|user:Name a colour.|")
    assert rendered({"chat_template_kwargs": {"greeting": "hi"}}).startswith("hi|user:")


def test_force_include_usage_and_the_response_role(flagged: Running) -> None:
    chunks = sse(post(flagged.url, "/v1/chat/completions", {**CHAT, "stream": True},
                      headers=AUTH))
    assert chunks[0]["choices"][0]["delta"]["role"] == "bot"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    whole = post(flagged.url, "/v1/chat/completions", CHAT, headers=AUTH).json()
    assert whole["choices"][0]["message"]["role"] == "bot"
    text = sse(post(flagged.url, "/v1/completions", {"prompt": "Hi", "max_tokens": 3,
                                                     "stream": True}, headers=AUTH))
    assert text[-1]["usage"]["completion_tokens"] == 3


def test_flag_values_are_checked() -> None:
    from vmkv.config import ServerConfig

    with pytest.raises(ValueError, match="default_chat_template_kwargs"):
        ServerConfig(default_chat_template_kwargs="[1, 2]")
    assert ServerConfig(api_key="one").api_key == ("one",)


