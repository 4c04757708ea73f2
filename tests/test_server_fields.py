"""Request fields that reach the engine, through the real openai client and raw HTTP on a real
server, in both KV modes: logit_bias, bad_words, allowed_token_ids, truncate_prompt_tokens,
continuous usage, chat echo / continue_final_message / prompt_logprobs, return_token_ids,
return_tokens_as_token_ids, and the stop-token text."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from serving import client_of, serve
from test_server import MODEL, Running, wait_idle

from vmkv.config import EngineConfig

PROMPT = "The capital of France is"
ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module", params=["virtual", "paged"])
def srv(request: pytest.FixtureRequest, default_model: object) -> Iterator[Running]:
    yield from serve(EngineConfig(kv_mode=request.param, max_model_len=256, max_num_seqs=8))


@pytest.fixture(scope="module")
def client(srv: Running) -> openai.OpenAI:
    return client_of(srv)


def token_id(srv: Running, text: str) -> int:
    (token,) = httpx.post(f"{srv.url}/tokenize", json={"prompt": text}).json()["tokens"]
    return token


def complete(client: openai.OpenAI, **kw: object):
    params = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **kw}
    return client.completions.create(**params)  # type: ignore[call-overload]


def test_logit_bias_bans_at_minus_100_and_forces_at_plus_100(srv: Running,
                                                            client: openai.OpenAI) -> None:
    paris = token_id(srv, " Paris")
    greedy = complete(client, extra_body={"return_token_ids": True}).choices[0]
    assert greedy.model_extra["token_ids"][0] == paris
    banned = complete(client, logit_bias={str(paris): -100}, n=3, temperature=1.2, seed=3,
                      extra_body={"return_token_ids": True, "ignore_eos": True})
    assert all(paris not in c.model_extra["token_ids"] for c in banned.choices)
    banana = token_id(srv, " banana")
    forced = complete(client, logit_bias={str(banana): 100},
                      extra_body={"return_token_ids": True, "ignore_eos": True})
    assert forced.choices[0].model_extra["token_ids"] == [banana] * 8
    chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6,
                                          temperature=0, logit_bias={str(banana): 100})
    assert chat.choices[0].message.content == " banana" * 6
    for bias, message in [({"12": 101}, "[-100, 100]"), ({"x": 1}, "token ids"),
                          ({"99999999": 1}, "token ids must be integers")]:
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": PROMPT, "logit_bias": bias})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
        assert message in r.json()["error"]["message"]


def test_bad_words_never_appear(client: openai.OpenAI) -> None:
    assert "Paris" in complete(client).choices[0].text
    for r in [complete(client, max_tokens=24, extra_body={"bad_words": ["Paris"]}),
              complete(client, max_tokens=24, n=3, temperature=0.9, seed=1,
                       extra_body={"bad_words": ["Paris", "France"]})]:
        for choice in r.choices:
            assert "Paris" not in choice.text, choice.text
    chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24,
                                          temperature=0, extra_body={"bad_words": ["Paris"]})
    assert "Paris" not in chat.choices[0].message.content


def test_allowed_token_ids_confine_the_output(srv: Running, client: openai.OpenAI) -> None:
    allowed = httpx.post(f"{srv.url}/tokenize", json={
        "prompt": " yes no maybe", "add_special_tokens": False}).json()["tokens"]
    r = complete(client, max_tokens=10, temperature=1.0, n=2, seed=4, extra_body={
        "allowed_token_ids": allowed, "return_token_ids": True, "ignore_eos": True})
    for choice in r.choices:
        assert set(choice.model_extra["token_ids"]) <= set(allowed)
        assert len(choice.model_extra["token_ids"]) == 10


def test_truncate_prompt_tokens_shows_in_usage(client: openai.OpenAI) -> None:
    full = complete(client, max_tokens=1)
    assert full.usage.prompt_tokens == 5
    cut = complete(client, max_tokens=1, extra_body={"truncate_prompt_tokens": 3})
    assert cut.usage.prompt_tokens == 3
    right = complete(client, max_tokens=1, echo=True, extra_body={
        "truncate_prompt_tokens": 2, "truncation_side": "right"})
    assert right.usage.prompt_tokens == 2 and right.choices[0].text.startswith("The capital")
    long = "word " * 400  # past max_model_len (256), accepted because it is cut
    assert complete(client, prompt=long, max_tokens=1,
                    extra_body={"truncate_prompt_tokens": 100}).usage.prompt_tokens == 100
    chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1,
                                          extra_body={"truncate_prompt_tokens": 7})
    assert chat.usage.prompt_tokens == 7


def test_continuous_usage_arrives_in_every_chunk(client: openai.OpenAI) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    for stream in [client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6,
                                             stream=True, stream_options=options),
                   client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6,
                                                  stream=True, stream_options=options)]:
        chunks = list(stream)
        assert len(chunks) >= 7 and all(c.usage is not None for c in chunks)
        counts = [c.usage.completion_tokens for c in chunks]
        assert counts == sorted(counts) and counts[-1] == 6
        assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
                   for c in chunks)
    plain = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3,
                                           stream=True))
    assert all(c.usage is None for c in plain)


def test_chat_continue_final_message_echo_and_prompt_logprobs(srv: Running,
                                                             client: openai.OpenAI) -> None:
    prefill = [*ASK, {"role": "assistant", "content": "The capital of France is"}]
    r = client.chat.completions.create(model=MODEL, messages=prefill, max_tokens=4,
                                       temperature=0, extra_body={
                                           "add_generation_prompt": False,
                                           "continue_final_message": True, "echo": True,
                                           "prompt_logprobs": 1})
    content = r.choices[0].message.content
    assert content.startswith("The capital of France is Paris"), content
    prompt_lp = r.model_extra["prompt_logprobs"]
    assert prompt_lp[0] is None and len(prompt_lp) == r.usage.prompt_tokens
    rendered = httpx.post(f"{srv.url}/tokenize", json={
        "messages": prefill, "add_generation_prompt": False,
        "continue_final_message": True, "return_token_strs": True}).json()
    assert rendered["count"] == r.usage.prompt_tokens
    assert "".join(rendered["token_strs"]).endswith("Ġis")  # left open: no end of turn
    stream = client.chat.completions.create(model=MODEL, messages=prefill, max_tokens=4,
                                            temperature=0, stream=True, extra_body={
                                                "add_generation_prompt": False,
                                                "continue_final_message": True, "echo": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream) == content
    r = httpx.post(f"{srv.url}/v1/chat/completions", json={
        "messages": prefill, "continue_final_message": True})  # add_generation_prompt: true
    assert r.status_code == 400 and "add_generation_prompt" in r.json()["error"]["message"]


def test_token_ids_and_tokens_as_ids(client: openai.OpenAI) -> None:
    r = complete(client, logprobs=2, extra_body={"return_token_ids": True,
                                                 "return_tokens_as_token_ids": True})
    choice = r.choices[0]
    ids = choice.model_extra["token_ids"]
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in ids]
    assert len(choice.model_extra["prompt_token_ids"]) == r.usage.prompt_tokens
    stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4,
                                            temperature=0, stream=True,
                                            extra_body={"return_token_ids": True})
    chunks = list(stream)
    assert chunks[0].model_extra["prompt_token_ids"]
    streamed = [t for c in chunks for t in (c.choices[0].model_extra.get("token_ids") or [])]
    assert len(streamed) == 4


def test_stop_token_text_is_left_out(srv: Running, client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60, temperature=0,
                                       extra_body={"skip_special_tokens": False})
    assert r.choices[0].finish_reason == "stop"
    assert not r.choices[0].message.content.endswith("<|im_end|>")
    paris = token_id(srv, " Paris")
    stopped = complete(client, extra_body={"stop_token_ids": [paris]}).choices[0]
    assert stopped.stop_reason == paris and stopped.text == ""
    kept = complete(client, extra_body={"stop_token_ids": [paris],
                                        "include_stop_str_in_output": True}).choices[0]
    assert kept.text == " Paris"


def test_nothing_is_held_after(srv: Running) -> None:
    assert wait_idle(srv.url)["vmkv:kv_physical_bytes_in_use"] == 0
