"""logit_bias, allowed_token_ids, bad_words and truncate_prompt_tokens: on logits, then in the
engine in both KV modes (greedy and sampled), and the engine's max_logprobs."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import torch

from vmkv import LLM, SamplingParams
from vmkv.sampling import Sampler, SamplingState
from vmkv.sampling.token_constraints import apply_token_constraints, banned_words_next

pytestmark = pytest.mark.usefixtures("default_model")
PROMPT = "The capital of France is"


# -- on logits ------------------------------------------------------------------------------------
def test_constraints_edit_only_their_rows() -> None:
    logits = torch.randn(3, 10)
    before = logits.clone()
    states = [SamplingState(SamplingParams(logit_bias={1: 2.5, 2: -100})),
              SamplingState(SamplingParams()),
              SamplingState(SamplingParams(allowed_token_ids=[4, 7]),
                            output_token_ids=[5, 6], bad_words_token_ids=((6, 7), (9,)))]
    apply_token_constraints(logits, states, [0, 2])
    assert logits[0, 1] == before[0, 1] + 2.5 and logits[0, 2] == float("-inf")
    assert torch.equal(logits[0, 3:], before[0, 3:])
    assert torch.equal(logits[1], before[1])  # bit for bit
    # row 2: only 4 and 7 allowed, and 7 completes the bad word (6, 7) after the output's 6
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [4]


def test_bad_words_ban_the_token_that_would_complete_them() -> None:
    words = ((1, 2, 3), (4,))
    assert banned_words_next(words, []) == [4]
    assert banned_words_next(words, [9, 1]) == [4]
    assert banned_words_next(words, [1, 2]) == [3, 4]
    assert banned_words_next(words, [2]) == [4]


def test_greedy_sampler_obeys_plus_and_minus_100() -> None:
    logits = torch.tensor([[5.0, 1.0, -3.0, 40.0]])
    sampler = Sampler()
    pick = lambda **kw: sampler(logits, [SamplingState(SamplingParams(temperature=0, **kw))])
    assert pick().token_ids == [3]
    assert pick(logit_bias={3: -100}).token_ids == [0]
    assert pick(logit_bias={2: 100}).token_ids == [2]  # additive: -3 + 100 > 40
    assert pick(allowed_token_ids=[1, 2]).token_ids == [1]


# -- in the engine, both KV modes -------------------------------------------------------------
@pytest.fixture(scope="module", params=["virtual", "paged"])
def llm(request: pytest.FixtureRequest) -> Iterator[LLM]:
    engine = LLM(kv_mode=request.param, max_model_len=256, max_num_seqs=8)
    yield engine
    engine.engine.close()


def run(llm: LLM, prompt: str | list[int] = PROMPT, **params: object):
    defaults = dict(temperature=0, max_tokens=12, ignore_eos=True)
    return llm.generate(prompt, SamplingParams(**{**defaults, **params}), use_tqdm=False)[0]


def test_logit_bias_minus_100_never_yields_the_token_and_plus_100_always_does(llm: LLM) -> None:
    greedy = run(llm).outputs[0].token_ids
    banned = greedy[0]  # " Paris"
    assert banned not in run(llm, logit_bias={banned: -100}).outputs[0].token_ids
    sampled = run(llm, logit_bias={banned: -100}, temperature=1.5, n=4, seed=0)
    assert all(banned not in c.token_ids for c in sampled.outputs)
    forced = llm.tokenizer.encode(" banana", add_special_tokens=False)[0]
    assert run(llm, logit_bias={forced: 100}).outputs[0].token_ids == [forced] * 12
    # a modest bias shifts, and is additive: the same as no bias when it is 0
    assert run(llm, logit_bias={forced: 0.0}).outputs[0].token_ids == greedy


def test_allowed_token_ids_confine_the_output(llm: LLM) -> None:
    allowed = llm.tokenizer.encode(" red green blue yes no", add_special_tokens=False)
    out = run(llm, allowed_token_ids=allowed, temperature=1.0, n=3, seed=1, max_tokens=16)
    for sample in out.outputs:
        assert set(sample.token_ids) <= set(allowed) and len(sample.token_ids) == 16


def contains(ids: list[int], word: list[int]) -> bool:
    return any(ids[i : i + len(word)] == word for i in range(len(ids)))


def test_bad_words_never_appear(llm: LLM) -> None:
    greedy = run(llm, max_tokens=24)
    assert "Paris" in greedy.outputs[0].text

    def forms(*words: str) -> list[list[int]]:
        return [llm.tokenizer.encode(t, add_special_tokens=False)
                for w in words for t in (w, " " + w)]

    out = run(llm, max_tokens=24, bad_words=["Paris", "France"], temperature=0.8, n=3, seed=2)
    for sample in out.outputs:
        assert not any(contains(sample.token_ids, w) for w in forms("Paris", "France"))
    plain = run(llm, max_tokens=24, bad_words=["Paris"]).outputs[0]
    assert "Paris" not in plain.text and not any(contains(plain.token_ids, w)
                                                 for w in forms("Paris"))
    # a word of several tokens is cut at its last token, wherever the model heads for it
    phrase = re.findall(r"[A-Za-z]+ [A-Za-z]+", greedy.outputs[0].text)[0]  # "The answer"
    assert all(len(w) > 1 for w in forms(phrase))
    assert any(contains(greedy.outputs[0].token_ids, w) for w in forms(phrase))
    ids = run(llm, max_tokens=24, bad_words=[phrase]).outputs[0].token_ids
    assert not any(contains(ids, w) for w in forms(phrase))
    assert ids[0] == greedy.outputs[0].token_ids[0]  # its first token is no bad word alone


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm: LLM) -> None:
    ids = llm.tokenizer.encode("One two three four five six seven eight nine ten")
    out = run(llm, ids, truncate_prompt_tokens=4)
    assert out.prompt_token_ids == ids[-4:]
    assert out.outputs[0].token_ids == run(llm, ids[-4:]).outputs[0].token_ids
    assert run(llm, ids, truncate_prompt_tokens=100).prompt_token_ids == ids
    long = ids * 30  # longer than max_model_len (256): -1 keeps the last 256, leaving no room
    with pytest.raises(ValueError, match="no room for output"):
        run(llm, long, truncate_prompt_tokens=-1)
    assert len(run(llm, long, truncate_prompt_tokens=200).prompt_token_ids) == 200
    llm.engine.kv.accounting.check()
    assert llm.engine.kv.accounting.usage.bytes_in_use == 0


def test_token_ids_past_the_vocabulary_and_logprobs_past_the_cap_are_refused(llm: LLM) -> None:
    vocab = llm.engine.model_config.vocab_size
    for params, name in [(dict(allowed_token_ids=[vocab]), "allowed_token_ids"),
                         (dict(logit_bias={vocab + 5: 1.0}), "logit_bias"),
                         (dict(stop_token_ids=[vocab]), "stop_token_ids"),
                         (dict(logprobs=21), "max_logprobs"),
                         (dict(prompt_logprobs=21, max_tokens=1), "max_logprobs")]:
        with pytest.raises(ValueError, match=name):
            run(llm, **params)
    assert not llm.engine.requests


def test_max_logprobs_is_the_engines_setting(default_model: object) -> None:
    llm = LLM(max_model_len=64, max_logprobs=-1, kv_cache_memory=16 << 20)
    try:
        out = run(llm, max_tokens=2, logprobs=50)
        assert all(len(entry) >= 50 for entry in out.outputs[0].logprobs)
    finally:
        llm.engine.close()
