"""Prompt logprobs: every prompt position, computed in the prefill chunks, equal to transformers'
log-softmax, whatever the chunking, prefix cache, preemption or KV mode; echo over HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
import transformers
from serving import serve
from test_server import MODEL, Running

from vmkv import LLM, SamplingParams
from vmkv.config import EngineConfig

PROMPTS = ["The capital of France is Paris, and the capital of Germany is Berlin.",
           "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
           "Once upon a time"]
K = 3


@pytest.fixture(scope="module")
def reference(default_model: Path) -> list[tuple[list[int], torch.Tensor]]:
    """(prompt ids, transformers' log-softmax ``[P, V]``) per prompt, float32."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(default_model,
                                                           dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model)
    out = []
    with torch.inference_mode():
        for text in PROMPTS:
            ids = tokenizer(text).input_ids
            logits = hf(torch.tensor([ids])).logits[0].float()  # [P, V]
            out.append((ids, logits.log_softmax(-1)))
    return out


def assert_matches(entries: list, ids: list[int], logprobs: torch.Tensor) -> None:
    """``entries`` (vmkv's prompt_logprobs) against transformers' ``logprobs [P, V]``."""
    assert len(entries) == len(ids) and entries[0] is None
    for pos in range(1, len(ids)):
        row = logprobs[pos - 1]
        entry = entries[pos]
        assert entry[ids[pos]] == pytest.approx(row[ids[pos]].item(), abs=2e-4)
        top = row.topk(K)
        for tok, want in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert entry[tok] == pytest.approx(want, abs=2e-4)
        assert len(entry) in (K, K + 1)  # the prompt token plus the top K (it may be one)


@pytest.mark.parametrize("kv_mode", ["virtual", "paged"])
def test_prompt_logprobs_equal_transformers_across_chunks_and_cache_hits(
        kv_mode: str, reference: list) -> None:
    # budget 8: every prompt is prefilled in several chunks; prefix caching on (the default)
    llm = LLM(kv_mode=kv_mode, max_model_len=256, max_num_batched_tokens=8)
    params = SamplingParams(max_tokens=0, prompt_logprobs=K)
    ids = [r[0] for r in reference]
    for _ in range(2):  # the second run would hit the prefix cache: it is recomputed instead
        outs = llm.generate(ids, params, use_tqdm=False)
        for out, (prompt, logprobs) in zip(outs, reference, strict=True):
            assert_matches(out.prompt_logprobs, prompt, logprobs)
            assert out.num_cached_tokens == 0
            assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    # generating too: the prompt's logprobs are unchanged, the samples share them (n=2)
    both = llm.generate(ids[0], SamplingParams(max_tokens=4, n=2, temperature=1, seed=0,
                                               ignore_eos=True, prompt_logprobs=K, logprobs=1),
                        use_tqdm=False)[0]
    assert_matches(both.prompt_logprobs, *reference[0])
    assert [len(o.token_ids) for o in both.outputs] == [4, 4]
    llm.engine.kv.accounting.check()
    assert llm.engine.kv.accounting.usage.bytes_in_use == 0


def test_prompt_logprobs_survive_recompute_preemption(reference: list) -> None:
    """A preempted sequence re-prefills its prompt; its logprobs are recorded once."""
    ids = [r[0] for r in reference] * 4
    tight = LLM(max_model_len=256, max_num_seqs=12, kv_cache_memory=3 * 60 * 46080)
    outs = tight.generate(ids, SamplingParams(max_tokens=30, ignore_eos=True, temperature=0,
                                              prompt_logprobs=K), use_tqdm=False)
    assert tight.engine.scheduler.stats.num_preemptions > 0
    for i, out in enumerate(outs):
        assert_matches(out.prompt_logprobs, *reference[i % len(reference)])
    tight.engine.kv.accounting.check()


def test_max_tokens_zero_is_only_for_scoring() -> None:
    with pytest.raises(ValueError, match="0 only with prompt_logprobs"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="prompt_logprobs must be >= 0"):
        SamplingParams(prompt_logprobs=-1)
    llm = LLM(max_model_len=64)
    with pytest.raises(ValueError, match=r"prompt_logprobs must be at most 20 \(max_logprobs\)"):
        llm.generate("hi", SamplingParams(max_tokens=0, prompt_logprobs=21), use_tqdm=False)
    with pytest.raises(ValueError, match="needs n=1"):
        llm.generate("hi", SamplingParams(max_tokens=0, prompt_logprobs=0, n=2), use_tqdm=False)
    assert not llm.engine.requests


# -- echo over HTTP -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def srv(default_model: Path) -> Iterator[Running]:
    yield from serve(EngineConfig(max_model_len=256, max_num_batched_tokens=16))


def completion(url: str, **body: object) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_returns_the_prompt_with_its_logprobs(srv: Running, reference: list,
                                                   max_tokens: int) -> None:
    ids, logprobs = reference[0]
    body = completion(srv.url, prompt=ids, echo=True, logprobs=1, max_tokens=max_tokens,
                      temperature=0)
    (choice,) = body["choices"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + max_tokens
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for pos in range(1, len(ids)):
        assert lp["token_logprobs"][pos] == pytest.approx(logprobs[pos - 1, ids[pos]].item(),
                                                          abs=2e-4)
        assert max(lp["top_logprobs"][pos].values()) == pytest.approx(
            logprobs[pos - 1].max().item(), abs=2e-4)
    assert lp["text_offset"][:2] == [0, len(lp["tokens"][0])]
    assert choice["text"].startswith(PROMPTS[0])
    assert body["usage"]["completion_tokens"] == max_tokens


def test_echo_streams_the_prompt_logprobs_first(srv: Running, reference: list) -> None:
    ids, logprobs = reference[2]
    with httpx.stream("POST", f"{srv.url}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": PROMPTS[2], "echo": True, "logprobs": 2,
            "max_tokens": 3, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    first = chunks[0]["choices"][0]
    assert first["text"] == PROMPTS[2]
    assert first["logprobs"]["token_logprobs"][1] == pytest.approx(
        logprobs[0, ids[1]].item(), abs=2e-4)
    assert len(first["logprobs"]["tokens"]) == len(ids)


def test_the_prompt_logprobs_extra_returns_them_without_echo(srv: Running,
                                                            reference: list) -> None:
    ids, logprobs = reference[1]
    body = completion(srv.url, prompt=ids, prompt_logprobs=2, max_tokens=0)
    (choice,) = body["choices"]
    assert choice["text"] == "" and choice["logprobs"] is None
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for pos in range(1, len(ids)):
        entry = entries[pos]
        assert next(iter(entry)) == str(ids[pos])  # the prompt token first, then the top 2
        assert entry[str(ids[pos])]["logprob"] == pytest.approx(
            logprobs[pos - 1, ids[pos]].item(), abs=2e-4)
        best = int(logprobs[pos - 1].argmax())
        assert entry[str(best)]["decoded_token"] == srv.engine.engine.tokenizer.decode([best])
def test_echo_without_logprobs_and_bad_prompt_logprobs(srv: Running) -> None:
    body = completion(srv.url, prompt="Hello there", echo=True, max_tokens=0)
    assert body["choices"][0]["text"] == "Hello there"
    assert body["choices"][0]["logprobs"] is None
    r = httpx.post(f"{srv.url}/v1/completions",
                   json={"model": MODEL, "prompt": "Hi", "max_tokens": 0})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    r = httpx.post(f"{srv.url}/v1/completions",
                   json={"model": MODEL, "prompt": "Hi", "prompt_logprobs": 50})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
