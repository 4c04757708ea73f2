"""Structured outputs in the engine: params, compilation, the bitmask in the sampler, forks."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import jsonschema
import pytest
import xgrammar as xgr

from vmkv import LLM, SamplingParams
from vmkv.structured import StructuredOutputsParams as S
from vmkv.structured.schema_check import UNENFORCED_KEYWORDS, check_schema_supported

pytestmark = pytest.mark.usefixtures("default_model")

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"]}


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM(max_model_len=384, max_num_seqs=16) as llm:
        yield llm


def chat(llm: LLM, text: str) -> list[int]:
    return llm.apply_chat_template([{"role": "user", "content": text}])


def test_params_need_exactly_one_valid_constraint() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        S()
    with pytest.raises(ValueError, match="exactly one"):
        S(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice"):
        S(choice="yes")
    with pytest.raises(ValueError, match="not valid JSON"):
        S(json="{nope")
    with pytest.raises(ValueError, match="unsupported structured_outputs fields: jsn"):
        S.from_dict({"jsn": {}})
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs=3)
    # a dict schema, its text and a dict in SamplingParams are the same (hashable) params
    assert S(json=PERSON) == S(json=json.dumps(PERSON))
    assert SamplingParams(structured_outputs={"json": PERSON}).structured_outputs == S(json=PERSON)
    assert hash(S(choice=["a", "b"])) == hash(S(choice=("a", "b")))


def test_keywords_xgrammar_would_not_enforce_are_refused() -> None:
    for keyword in UNENFORCED_KEYWORDS:
        schema = {"type": "object", "properties": {"x": {"type": "integer", keyword: 3}}}
        with pytest.raises(ValueError, match=f"'{re.escape(keyword)}' \\(at #/properties/x\\)"):
            check_schema_supported(schema)
    # a property *named* like a keyword is no keyword
    check_schema_supported({"type": "object", "properties": {"not": {"type": "string"}},
                            "required": ["not"]})


def test_the_refused_keywords_really_go_unenforced(llm: LLM) -> None:
    """Why the list exists: xgrammar compiles these schemas but accepts violating output."""
    compiler = llm.engine.grammars._xgr_compiler()
    for schema, violating in [({"type": "number", "multipleOf": 3}, "4.5"),
                              ({"type": "array", "items": {"type": "integer"},
                                "contains": {"const": 5}}, "[1]"),
                              ({"not": {"type": "string"}}, '"a"')]:
        matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema)))
        assert matcher.accept_string(violating)


def test_bad_constraints_are_value_errors_and_queue_nothing(llm: LLM) -> None:
    bad = [S(json={"type": "foo"}), S(json={"type": "number", "multipleOf": 2}),
           S(regex="(unclosed"), S(grammar="root ::= undefined_rule")]
    for so in bad:
        with pytest.raises(ValueError, match=f"invalid structured_outputs.{so.kind}"):
            llm.generate("hi", SamplingParams(structured_outputs=so), use_tqdm=False)
    assert not llm.engine.requests and not llm.engine.scheduler.has_work()
    llm.engine.kv.accounting.check()


def test_grammars_are_compiled_once_per_params(llm: LLM) -> None:
    cache = llm.engine.grammars
    so = S(json={**PERSON, "title": "once"})
    before = (cache.stats.misses, cache.stats.hits)
    assert not cache.is_compiled(so)
    first, second = cache.compile(so), cache.compile(S(json=json.dumps({**PERSON,
                                                                        "title": "once"})))
    assert first is second and cache.is_compiled(so)
    assert (cache.stats.misses - before[0], cache.stats.hits - before[1]) == (1, 1)


def test_every_kind_constrains_every_sample(llm: LLM) -> None:
    prompt = chat(llm, "Describe a person.")
    cases = [
        (S(json=PERSON), lambda t: jsonschema.validate(json.loads(t), PERSON)),
        (S(json=PERSON, disable_any_whitespace=True),
         lambda t: re.fullmatch(r'\{"name": "[^"]*", "age": \d+\}', t) or pytest.fail(t)),
        (S(json_object=True), lambda t: isinstance(json.loads(t), dict) or pytest.fail(t)),
        (S(regex=r"[0-9]{3}-[a-z]{2,6}"),
         lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,6}", t) or pytest.fail(t)),
        (S(choice=["yes", "no", "maybe so"]),
         lambda t: t in ("yes", "no", "maybe so") or pytest.fail(t)),
        (S(grammar='root ::= "A" ("B" | "C")*  "D"'),
         lambda t: re.fullmatch("A[BC]*D", t) or pytest.fail(t)),
    ]
    # json_object bounds nothing: sampled, the small model may list things until max_tokens
    params = [SamplingParams(temperature=0 if so.json_object else 0.8, seed=i, n=2,
                             max_tokens=120, structured_outputs=so)
              for i, (so, _) in enumerate(cases)]
    outs = llm.generate([prompt] * len(cases), params, use_tqdm=False)
    for (_, check), out in zip(cases, outs, strict=True):
        assert len(out.outputs) == 2
        for sample in out.outputs:
            assert sample.finish_reason == "stop", sample.text
            check(sample.text)


def test_the_mask_leaves_unconstrained_rows_alone(llm: LLM) -> None:
    prompt = chat(llm, "Name a colour.")
    free = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = llm.generate(prompt, free, use_tqdm=False)[0].outputs[0].token_ids
    constrained = SamplingParams(temperature=0, max_tokens=16,
                                 structured_outputs=S(choice=["red", "blue"]))
    outs = llm.generate([prompt, prompt, prompt], [constrained, free, constrained],
                        use_tqdm=False)
    assert outs[1].outputs[0].token_ids == alone
    assert outs[0].outputs[0].text in ("red", "blue")


def test_a_finished_grammar_ends_the_sequence_even_with_ignore_eos(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, min_tokens=10,
                            structured_outputs=S(choice=["yes", "no"]))
    out = llm.generate(chat(llm, "Yes or no?"), params, use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    assert len(out.token_ids) < 10  # the grammar, not min_tokens, decides when to end
    llm.engine.kv.accounting.check()
    assert llm.engine.kv.accounting.usage.bytes_in_use == 0


def test_stop_strings_and_aborts_end_constrained_sequences(llm: LLM) -> None:
    engine = llm.engine
    prompt = chat(llm, "Describe a person.")
    so = S(json=PERSON)
    # a stop string inside the document ends it there (the text is cut before it)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=60, stop=['"age"'],
                                              structured_outputs=so), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == '"age"'
    assert out.outputs[0].text.startswith("{") and '"age"' not in out.outputs[0].text
    # aborted after a few constrained steps (n=2: the forked matchers too): nothing is held
    engine.add_request("abort-me", prompt, SamplingParams(n=2, temperature=0.8, seed=1,
                                                          max_tokens=60, structured_outputs=so))
    for _ in range(6):
        engine.step()
    req = engine.requests["abort-me"]
    states = [s.sampling_state.grammar for s in req.seqs]
    assert len(states) == 2 and states[0].matcher is not states[1].matcher
    assert engine.abort_request("abort-me").finished
    assert not engine.has_unfinished_requests()
    engine.kv.accounting.check()
    assert engine.kv.accounting.usage.bytes_in_use == 0
