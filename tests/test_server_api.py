"""The API's edges on a real server: every declared field honoured or refused with a 400 naming
it, unknown fields logged, token ids that are no integers, JSON nested too deep, echo of the
prompt as sent, and the server options: several served names, --chat-template with
chat_template_kwargs, --generation-config, CORS, X-Request-Id, --max-logprobs, request logging,
and the development routes."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from serving import client_of, serve
from test_server import Running, start

from vmkv.chat_template import load_chat_template
from vmkv.cli import build_parser
from vmkv.config import EngineConfig
from vmkv.config_args import server_config
from vmkv.models import load_tokenizer, resolve_model
from vmkv.server.generation_config import generation_defaults
from vmkv.server.limits import MAX_JSON_DEPTH
from vmkv.server.protocol import REFUSED

ORIGIN = "https://app.example"
TEMPLATE = ("{% if refuse is defined %}{{ raise_exception('not today') }}{% endif %}"
            "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
            "'<|im_end|>\\n' }}{% endfor %}{% if greeting is defined %}{{ greeting }}"
            "{% endif %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
            "{% endif %}")
ASK = [{"role": "user", "content": "Hi"}]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def bos_tokenizer(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Path:
    """The default tokenizer, adding BOS (<|im_start|>) before every prompt, as Llama's do."""
    folder = tmp_path_factory.mktemp("bos-tokenizer")
    tokenizer = load_tokenizer(default_model)
    tokenizer.add_bos_token = True
    tokenizer.save_pretrained(folder)
    shutil.copy(default_model / "config.json", folder)
    return folder


@pytest.fixture(scope="module")
def generation_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("generation-config")
    (folder / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "max_new_tokens": 5, "do_sample": True}))
    return folder


@pytest.fixture(scope="module")
def srv(bos_tokenizer: Path, generation_dir: Path) -> Iterator[Running]:
    yield from serve(
        EngineConfig(tokenizer=str(bos_tokenizer), max_model_len=256, max_num_seqs=8,
                     max_logprobs=5),
        served_model_name=("smol", "alias"), allowed_origins=(ORIGIN,), chat_template=TEMPLATE,
        generation_config=str(generation_dir), enable_log_requests=True, max_log_len=12)


@pytest.fixture(scope="module")
def client(srv: Running) -> openai.OpenAI:
    return client_of(srv)


def post(srv: Running, path: str, body: object,
         headers: dict[str, str] | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{srv.url}{path}", content=content, timeout=60,
                      headers={"Content-Type": "application/json", **(headers or {})})


def assert_400(r: httpx.Response, param: str | None, text: str = "") -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and text in error["message"], error


# -- fields -----------------------------------------------------------------------------------
REFUSALS = [(name, value, "/v1/chat/completions" if name in (
    "media_io_kwargs", "functions", "function_call", "audio") else
    "/v1/completions") for name, value in [
        ("use_beam_search", True), ("length_penalty", 0.5), ("watermarking", True),
        ("spaces_between_special_tokens", False), ("logprob_token_ids", [1]),
        ("priority", 1), ("repetition_detection", {"n": 3}), ("thinking_token_budget", 10),
        ("mm_processor_kwargs", {"a": 1}), ("media_io_kwargs", {"image": {}}),
        ("prompt_embeds", "AAAA"),
        ("functions", [{"name": "f"}]), ("function_call", "auto"), ("audio", {"voice": "x"})]]


def test_every_refused_field_is_tested() -> None:
    assert {name for name, _, _ in REFUSALS} == set(REFUSED)


@pytest.mark.parametrize(("name", "value", "path"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_fields_vmkv_cannot_honour_get_400_naming_them(srv: Running, name: str, value: object,
                                                      path: str) -> None:
    body = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": ASK}
    assert_400(post(srv, path, {**body, name: value}), name, "rather than ignore it")
    assert post(srv, path, {**body, "max_tokens": 1, name: REFUSED[name][0]}).status_code == 200


def test_unknown_fields_are_ignored_with_a_warning(srv: Running,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="vmkv.server"):
        r = post(srv, "/v1/chat/completions", {"messages": ASK, "max_tokens": 1,
                                               "service_tier": "auto", "stream": True,
                                               "stream_options": {"obfuscate": True}})
    assert r.status_code == 200
    assert "ignored request fields (vmkv does not know them): service_tier" in caplog.text


def test_unenforceable_schema_keywords_get_400(srv: Running) -> None:
    for schema, keyword in [({"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True},
                             "uniqueItems"),
                            ({"allOf": [{"type": "integer"}, {"maximum": 5}]}, "allOf"),
                            ({"type": "object", "properties": {"a": {"type": "integer"}},
                              "dependentRequired": {"a": ["b"]}}, "dependentRequired")]:
        r = post(srv, "/v1/chat/completions", {"messages": ASK, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
        assert_400(r, "response_format", f"'{keyword}'")


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": [1.0, 1e15]}, "prompt"),
    ("/v1/completions", {"prompt": [-5.0]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], [3, 2.0]]}, "prompt.1"),
    ("/v1/completions", {"prompt": [1, True]}, "prompt"),
    ("/v1/completions", {"prompt": [1, 10**9]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [1.5]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": [1e15]}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1e3": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": ASK, "stop_token_ids": [2.0]}, "stop_token_ids"),
    ("/v1/chat/completions", {"messages": ASK, "allowed_token_ids": [10**9]},
     "allowed_token_ids"),
    ("/detokenize", {"tokens": [1.0, 1e15]}, "tokens"),
    ("/detokenize", {"tokens": [7, -1]}, "tokens"),
])
def test_token_ids_must_be_integers_in_the_vocabulary(srv: Running, path: str, body: dict,
                                                      param: str) -> None:
    r = post(srv, path, body)
    assert_400(r, param, "token ids must be integers in [0, 49152)")
    assert httpx.get(f"{srv.url}/health").status_code == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses",
                                  "/tokenize", "/detokenize"])
def test_a_50000_deep_body_gets_400_naming_the_limit(srv: Running, path: str) -> None:
    for body in [b"[" * 50_000 + b"]" * 50_000,
                 b'{"prompt": ' + b"[" * 50_000 + b"1" + b"]" * 50_000 + b"}",
                 b'{"messages": [{"role": "user", "content": "x", "a": '
                 + b'{"a": ' * (MAX_JSON_DEPTH + 1) + b"1" + b"}" * (MAX_JSON_DEPTH + 1)
                 + b"}]}"]:
        assert_400(post(srv, path, body), None, f"deeper than {MAX_JSON_DEPTH} levels")
    ok = b'{"prompt": "' + b"[" * 1000 + b'"}'  # brackets in a string do not nest
    assert post(srv, "/tokenize", ok).status_code == 200
    assert httpx.get(f"{srv.url}/health").status_code == 200


# -- echo, chat template, generation config -------------------------------------------------
def test_echo_returns_the_prompt_as_sent_with_right_offsets(client: openai.OpenAI) -> None:
    r = client.completions.create(model="smol", prompt=PROMPT, max_tokens=3, echo=True,
                                  logprobs=1, temperature=0)
    choice = r.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(PROMPT) and not choice.text.startswith("<|im_start|>")
    assert lp.tokens[0] == "<|im_start|>" and lp.text_offset[:2] == [0, 0]  # BOS: not in text
    for token, offset in zip(lp.tokens[1:], lp.text_offset[1:], strict=True):
        assert choice.text[offset : offset + len(token)] == token
    assert lp.text_offset[r.usage.prompt_tokens] == len(PROMPT)
    chunks = list(client.completions.create(model="smol", prompt=PROMPT, max_tokens=3,
                                            echo=True, stream=True, temperature=0))
    assert chunks[0].choices[0].text == PROMPT
    assert "".join(c.choices[0].text for c in chunks) == choice.text


def test_chat_template_kwargs_reach_the_template(srv: Running, client: openai.OpenAI) -> None:
    def rendered(**kw: object) -> str:
        ids = post(srv, "/tokenize", {"messages": ASK, **kw}).json()["tokens"]
        return post(srv, "/detokenize", {"tokens": ids}).json()["prompt"]

    assert "Bonjour" in rendered(chat_template_kwargs={"greeting": "Bonjour"})
    assert "Bonjour" not in rendered()
    plain = client.chat.completions.create(model="smol", messages=ASK, max_tokens=1)
    greeted = client.chat.completions.create(model="smol", messages=ASK, max_tokens=1,
                                             extra_body={"chat_template_kwargs": {
                                                 "greeting": "Bonjour tout le monde"}})
    assert greeted.usage.prompt_tokens > plain.usage.prompt_tokens
    assert_400(post(srv, "/v1/chat/completions", {
        "messages": ASK, "chat_template_kwargs": {"tokenize": False}}),
        "chat_template_kwargs", "'tokenize'")
    assert_400(post(srv, "/v1/chat/completions", {"messages": ASK, "chat_template": "{{ 1 }}"}),
               "chat_template", "--trust-request-chat-template")
    r = post(srv, "/v1/chat/completions", {"messages": ASK, "chat_template_kwargs": {
        "refuse": True}})  # the template raises: a 400, not a 500
    assert_400(r, "messages", "the chat template refused the messages: not today")


def test_chat_template_from_a_file_or_inline(tmp_path: Path) -> None:
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    assert load_chat_template(str(tmp_path / "t.jinja")) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE and load_chat_template(None) is None
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_generation_config_defaults_apply_to_unset_fields(client: openai.OpenAI,
                                                          generation_dir: Path) -> None:
    texts = {client.completions.create(model="smol", prompt=PROMPT, seed=seed,
                                       extra_body={"ignore_eos": True}).choices[0].text
             for seed in range(3)}
    assert len(texts) == 1  # temperature 0 from the file: greedy whatever the seed
    r = client.completions.create(model="smol", prompt=PROMPT, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5  # max_new_tokens
    sampled = {client.completions.create(model="smol", prompt=PROMPT, seed=seed, max_tokens=20,
                                         temperature=1.0).choices[0].text for seed in range(3)}
    assert len(sampled) > 1  # a request that sets a field keeps it
    assert generation_defaults("vmkv", generation_dir) == {}
    assert generation_defaults(str(generation_dir), None) == {"temperature": 0.0,
                                                              "max_tokens": 5}
    assert generation_defaults("auto", resolve_model(None, progress=False)) == {}
    with pytest.raises(ValueError, match="no generation_config.json"):
        generation_defaults(str(generation_dir / "nope"), None)


# -- server options ---------------------------------------------------------------------------
def test_several_served_names(srv: Running, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["smol", "alias"]
    r = client.completions.create(model="alias", prompt=PROMPT, max_tokens=1)
    assert r.model == "smol"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt=PROMPT, max_tokens=1)


def test_x_request_id_is_echoed(srv: Running) -> None:
    headers = {"X-Request-Id": "trace-42"}
    r = post(srv, "/v1/chat/completions", {"messages": ASK, "max_tokens": 1}, headers=headers)
    assert r.headers["x-request-id"] == "trace-42" and r.json()["id"] == "chatcmpl-trace-42"
    r = post(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "stream": True},
             headers=headers)
    assert r.headers["x-request-id"] == "trace-42" and '"id": "cmpl-trace-42"' in r.text
    assert post(srv, "/v1/completions", {"prompt": []}, headers=headers).headers[
        "x-request-id"] == "trace-42"  # errors too
    assert httpx.get(f"{srv.url}/health", headers=headers).headers["x-request-id"] == "trace-42"
    assert "x-request-id" not in httpx.get(f"{srv.url}/health").headers
    body = post(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1,
                                         "request_id": "mine"}).json()
    assert body["id"] == "cmpl-mine"


def test_cors_answers_the_allowed_origins_only(srv: Running) -> None:
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type,authorization"}
    ok = httpx.options(f"{srv.url}/v1/chat/completions", headers={"Origin": ORIGIN,
                                                                  **preflight})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(f"{srv.url}/v1/chat/completions",
                          headers={"Origin": "https://evil.example", **preflight})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    r = httpx.get(f"{srv.url}/v1/models", headers={"Origin": ORIGIN})
    assert r.headers["access-control-allow-origin"] == ORIGIN


def test_max_logprobs(srv: Running) -> None:
    assert post(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1,
                                         "logprobs": 5}).status_code == 200
    assert_400(post(srv, "/v1/completions", {"prompt": PROMPT, "logprobs": 6}), "logprobs",
               "max_logprobs")
    assert_400(post(srv, "/v1/chat/completions", {"messages": ASK, "logprobs": True,
                                                  "top_logprobs": 6}), "top_logprobs",
               "max_logprobs")  # named as sent (vLLM's): top_logprobs


def test_requests_are_logged(srv: Running, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="vmkv.server"):
        post(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "user": "alice"},
             headers={"X-Request-Id": "logged-1"})
    line = next(r.getMessage() for r in caplog.records if "cmpl-logged-1" in r.getMessage())
    assert "/v1/completions user=alice prompt_tokens=6" in line
    assert line.endswith('prompt="The capital...')  # the first max_log_len characters


def test_development_routes_need_dev_mode(srv: Running) -> None:
    assert post(srv, "/reset_prefix_cache", {}).status_code == 404
    dev = start(srv.engine, dev_mode=True)  # `--dev-mode`, or VMKV_SERVER_DEV_MODE=1
    try:
        r = post(dev, "/reset_prefix_cache", {})
        assert r.status_code == 200 and "dropped_units" in r.json()
    finally:
        dev.stop()


def test_dev_mode_defaults_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """``vmkv serve`` reads VMKV_SERVER_DEV_MODE into ``--dev-mode``'s default (a switch:
    ``0`` is off); the server reads only the config."""
    def dev_mode(*argv: str) -> bool:
        return server_config(build_parser().parse_args(["serve", *argv])).dev_mode

    monkeypatch.delenv("VMKV_SERVER_DEV_MODE", raising=False)
    assert not dev_mode() and dev_mode("--dev-mode")
    monkeypatch.setenv("VMKV_SERVER_DEV_MODE", "0")
    assert not dev_mode()
    monkeypatch.setenv("VMKV_SERVER_DEV_MODE", "1")
    assert dev_mode() and not dev_mode("--no-dev-mode")


def test_the_docs_list_every_request_field() -> None:
    """docs/server.md's table says for every declared field whether it is honoured, refused
    or not applicable."""
    from vmkv.server.protocol import (
        ChatCompletionRequest,
        CompletionRequest,
        DetokenizeRequest,
        StreamOptions,
        TokenizeRequest,
    )
    from vmkv.server.responses_request import ResponsesRequest

    doc = (Path(__file__).parents[1] / "docs" / "server.md").read_text()
    table = doc[doc.index("## Request fields against vLLM's"):doc.index("## Server options")]
    for model in (CompletionRequest, ChatCompletionRequest, ResponsesRequest, TokenizeRequest,
                  DetokenizeRequest, StreamOptions):
        prefix = "stream_options." if model is StreamOptions else ""
        for name in model.model_fields:
            assert f"`{prefix}{name}" in table, f"{model.__name__}.{name} is not in the table"
