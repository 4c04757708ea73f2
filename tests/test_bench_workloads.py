"""Workload generators: seeded, reproducible, the published ShareGPT/Alpaca means, jsonl."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from vmkv.bench import workloads as wl

VOCAB, SPECIAL = 1000, [0, 1, 2, 7]


def _build(name: str, seed: int = 0, n: int = 300, **kw: object) -> list[wl.BenchRequest]:
    return wl.build(wl.WorkloadSpec(name=name, num_prompts=n, seed=seed, **kw), VOCAB, SPECIAL)


@pytest.mark.parametrize("name", ["random", "sharegpt-like", "alpaca-like", "long-context",
                                  "shared-prefix"])
def test_same_seed_same_requests_other_seed_differs(name: str) -> None:
    a, b, c = _build(name, 3, 20), _build(name, 3, 20), _build(name, 4, 20)
    assert a == b
    assert a != c
    assert all(isinstance(r.output_len, int) and r.output_len > 0 for r in a)
    ids = np.concatenate([r.prompt_token_ids for r in a])
    assert ids.min() >= 0 and ids.max() < VOCAB
    assert not set(ids.tolist()) & set(SPECIAL)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("name", "means"), [("sharegpt-like", (161.31, 337.99)),
                                             ("alpaca-like", (19.31, 58.45))])
def test_lognormal_workloads_match_the_published_means(name: str, means: tuple[float, float],
                                                       seed: int) -> None:
    reqs = _build(name, seed, 300)
    ins = np.array([len(r.prompt_token_ids) for r in reqs])
    outs = np.array([r.output_len for r in reqs])
    assert ins.mean() == pytest.approx(means[0], rel=0.02)
    assert outs.mean() == pytest.approx(means[1], rel=0.02)
    assert ins.min() >= 4 and outs.min() >= 4
    assert ins.std() > 0.5 * ins.mean()  # a real spread, not a constant
    assert len(set(ins.tolist())) > 50


def test_random_and_long_context_lengths_stay_in_range() -> None:
    reqs = _build("random", n=200, input_len=(5, 9), output_len=(3, 3))
    assert {len(r.prompt_token_ids) for r in reqs} == set(range(5, 10))
    assert {r.output_len for r in reqs} == {3}
    long = _build("long-context", n=20)
    assert all(2000 <= len(r.prompt_token_ids) <= 4000 for r in long)
    assert all(256 <= r.output_len <= 512 for r in long)


def test_shared_prefix_requests_share_exactly_the_prefix() -> None:
    reqs = _build("shared-prefix", n=10, prefix_len=300, input_len=(5, 10))
    prefix = reqs[0].prompt_token_ids[:300]
    assert all(r.prompt_token_ids[:300] == prefix for r in reqs)
    assert all(305 <= len(r.prompt_token_ids) <= 310 for r in reqs)
    assert len({tuple(r.prompt_token_ids[300:]) for r in reqs}) == 10


def test_jsonl_round_trip_and_text_prompts(tmp_path: Path) -> None:
    reqs = _build("random", n=5, input_len=(3, 6), output_len=(2, 4))
    path = tmp_path / "w.jsonl"
    wl.save_jsonl(reqs, path)
    assert wl.build(wl.WorkloadSpec("jsonl", num_prompts=5, path=str(path)), VOCAB) == reqs
    path.write_text(json.dumps({"prompt": "a b c", "output_len": 4}) + "\n")
    got = wl.load_jsonl(path, encode=lambda text: [len(w) for w in text.split()])
    assert got == [wl.BenchRequest([1, 1, 1], 4)]
    with pytest.raises(ValueError, match="needs a tokenizer"):
        wl.load_jsonl(path)
    path.write_text(json.dumps({"prompt": [1], "output_len": 0}) + "\n")
    with pytest.raises(ValueError, match="output_len must be a positive int"):
        wl.load_jsonl(path)


def test_bad_specs_are_rejected() -> None:
    with pytest.raises(ValueError, match="LO:HI"):
        wl.parse_range("9:3")
    assert wl.parse_range("7") == (7, 7)
    with pytest.raises(ValueError, match="workload must be one of"):
        wl.WorkloadSpec(name="nope")
    with pytest.raises(ValueError, match="fixed length distributions"):
        _build("sharegpt-like", input_len=(1, 2))
    with pytest.raises(ValueError, match="needs a file"):
        wl.WorkloadSpec(name="jsonl")
