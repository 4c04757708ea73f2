"""Sampling: SamplingParams validation, truncation masks, penalties, the sampler and logprobs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from vmkv.sampling import Sampler, SamplingState
from vmkv.sampling.penalties import apply_min_tokens, apply_penalties
from vmkv.sampling.truncation import apply_min_p, apply_top_k, apply_top_p
from vmkv.sampling_params import MAX_LOGPROBS, RequestOutputKind, SamplingParams

NEG_INF = float("-inf")


def kept(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(row > NEG_INF).flatten().tolist())


def log_probs(*probs: float) -> torch.Tensor:
    return torch.tensor([probs]).log()  # [1, V]


def state(params: SamplingParams | None = None, **kwargs: object) -> SamplingState:
    return SamplingState(params or SamplingParams(), **kwargs)  # type: ignore[arg-type]


# --- SamplingParams -----------------------------------------------------------------------------


def test_defaults_are_vllms() -> None:
    p = SamplingParams()
    expected = dict(
        n=1, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=None, max_tokens=16,
        min_tokens=0, stop=(), stop_token_ids=(), ignore_eos=False, logprobs=None,
        presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
        include_stop_str_in_output=False, skip_special_tokens=True, prompt_logprobs=None,
        structured_outputs=None, structured_outputs_after=None,  # vmkv's: vLLM's reasoner
        output_kind=RequestOutputKind.CUMULATIVE, logit_bias=None,
        allowed_token_ids=None, bad_words=None, truncate_prompt_tokens=None,
    )  # fmt: skip
    assert dataclasses.asdict(p) == expected
    assert not p.is_greedy


@pytest.mark.parametrize(
    ("stop", "expected"),
    [(None, ()), ("END", ("END",)), (["a", "bc"], ("a", "bc")), (("x",), ("x",))],
)
def test_stop_is_normalised_to_tuple(stop: object, expected: tuple[str, ...]) -> None:
    assert SamplingParams(stop=stop).stop == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("ids", "expected"), [(None, ()), ([2, 7], (2, 7)), ((0,), (0,)), (range(3), (0, 1, 2))]
)
def test_stop_token_ids_are_normalised_to_tuple(ids: object, expected: tuple[int, ...]) -> None:
    assert SamplingParams(stop_token_ids=ids).stop_token_ids == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("temperature", "is_greedy"), [(0, True), (0.0, True), (1e-6, True), (1e-3, False), (2, False)]
)
def test_is_greedy(temperature: float, is_greedy: bool) -> None:
    assert SamplingParams(temperature=temperature).is_greedy is is_greedy


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(top_k=-1), dict(top_k=0), dict(top_p=1.0), dict(min_p=1.0), dict(logprobs=0),
        dict(logprobs=MAX_LOGPROBS), dict(logprobs=1000), dict(seed=0), dict(seed=-5),
        dict(max_tokens=None, min_tokens=10_000), dict(min_tokens=16),
        dict(presence_penalty=-2, frequency_penalty=2), dict(repetition_penalty=0.01),
        dict(temperature=0), dict(logit_bias={3: -100, 4: 100.0}), dict(allowed_token_ids=[0]),
        dict(bad_words=["a b"]), dict(truncate_prompt_tokens=-1), dict(truncate_prompt_tokens=1),
    ],
)  # fmt: skip
def test_valid_edges_are_accepted(kwargs: dict[str, object]) -> None:
    SamplingParams(**kwargs)  # type: ignore[arg-type]


BAD = [
    # (field, bad value, text the message must contain besides the field name)
    ("n", 0, "0"),
    ("n", 1.5, "1.5"),
    ("n", True, "True"),
    ("temperature", -1, "-1"),
    ("temperature", "hot", "'hot'"),
    ("temperature", math.nan, "nan"),
    ("temperature", math.inf, "inf"),
    ("top_p", 0.0, "0.0"),
    ("top_p", 1.5, "1.5"),
    ("top_p", math.nan, "nan"),
    ("top_k", -2, "-2"),
    ("top_k", 2.5, "2.5"),
    ("min_p", -0.1, "-0.1"),
    ("min_p", 1.1, "1.1"),
    ("seed", 1.5, "1.5"),
    ("seed", "7", "'7'"),
    ("seed", 2**64, str(2**64)),
    ("max_tokens", 0, "0"),
    ("max_tokens", 8.0, "8.0"),
    ("min_tokens", -1, "-1"),
    ("min_tokens", 17, "17"),  # > max_tokens=16
    ("presence_penalty", 2.5, "2.5"),
    ("presence_penalty", "x", "'x'"),
    ("frequency_penalty", -3, "-3"),
    ("repetition_penalty", 0, "0"),
    ("repetition_penalty", -1.0, "-1.0"),
    ("repetition_penalty", math.inf, "inf"),
    ("logprobs", -1, "-1"),
    ("logprobs", 2.0, "2.0"),
    ("stop", "", "''"),
    ("stop", ["ok", ""], "''"),
    ("stop", [3], "3"),
    ("stop", 5, "5"),
    ("stop_token_ids", [-1], "-1"),
    ("stop_token_ids", [1.5], "1.5"),
    ("stop_token_ids", "12", "'12'"),
    ("stop_token_ids", 5, "5"),
    ("ignore_eos", "yes", "'yes'"),
    ("include_stop_str_in_output", 1, "1"),
    ("skip_special_tokens", None, "None"),
    ("logit_bias", {5: 101}, "101"),
    ("logit_bias", {5: -100.5}, "-100.5"),
    ("logit_bias", {-1: 1}, "-1"),
    ("logit_bias", {"5": 1}, "'5'"),
    ("logit_bias", [5], "[5]"),
    ("allowed_token_ids", [], "empty"),
    ("allowed_token_ids", [1.0], "1.0"),
    ("allowed_token_ids", 5, "5"),
    ("bad_words", "word", "'word'"),
    ("bad_words", ["ok", " "], "' '"),
    ("truncate_prompt_tokens", 0, "0"),
    ("truncate_prompt_tokens", -2, "-2"),
    ("truncate_prompt_tokens", 1.5, "1.5"),
]


@pytest.mark.parametrize(("field", "value", "shown"), BAD, ids=[f"{f}={v!r}" for f, v, _ in BAD])
def test_invalid_value_error_names_field_and_value(field: str, value: object, shown: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    message = str(info.value)
    assert field in message
    assert shown in message.split(field, 1)[1]


def test_params_are_frozen_after_validation() -> None:
    p = SamplingParams(temperature=0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.0  # type: ignore[misc]
    assert dataclasses.replace(p, max_tokens=None).max_tokens is None


# --- truncation masks ---------------------------------------------------------------------------


def test_top_k_keeps_exactly_the_k_largest() -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0, -1.0], [0.0, 5.0, 4.0, 3.0, 2.0]])
    out = apply_top_k(logits, torch.tensor([2, 3]), max_k=3)
    assert kept(out[0]) == {0, 2}
    assert kept(out[1]) == {1, 2, 3}
    assert torch.equal(out[0, [0, 2]], logits[0, [0, 2]])  # kept logits unchanged


def test_top_k_keeps_ties_with_the_kth() -> None:
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0]])
    assert kept(apply_top_k(logits, torch.tensor([1]), max_k=1)[0]) == {1, 2}


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    # probabilities 0.15, 0.5, 0.05, 0.3 (sorted: 1, 3, 0, 2)
    logits = log_probs(0.15, 0.5, 0.05, 0.3).repeat(4, 1)
    out = apply_top_p(logits, torch.tensor([0.4, 0.75, 0.85, 0.99]))
    assert [kept(row) for row in out] == [{1}, {1, 3}, {1, 3, 0}, {0, 1, 2, 3}]


def test_top_p_stops_once_mass_reaches_p_exactly() -> None:
    logits = log_probs(0.5, 0.25, 0.125, 0.125).repeat(2, 1)  # exact in float32
    out = apply_top_p(logits, torch.tensor([0.5, 0.75]))
    assert [kept(row) for row in out] == [{0}, {0, 1}]


def test_top_p_one_keeps_everything_even_when_cumsum_rounds_to_one() -> None:
    logits = torch.tensor([[30.0] + [0.0] * 9])  # p0 rounds to 1.0 in float32
    assert kept(apply_top_p(logits, torch.tensor([1.0]))[0]) == set(range(10))


def test_top_p_keeps_ties_with_the_last_kept() -> None:
    logits = log_probs(0.4, 0.2, 0.2, 0.2)
    assert kept(apply_top_p(logits, torch.tensor([0.5]))[0]) == {0, 1, 2, 3}


def test_min_p_keeps_tokens_at_least_min_p_times_the_top() -> None:
    logits = log_probs(0.05, 0.5, 0.15, 0.3).repeat(3, 1)
    out = apply_min_p(logits, torch.tensor([0.2, 0.5, 0.95]))
    assert [kept(row) for row in out] == [{1, 2, 3}, {1, 3}, {1}]


def test_off_rows_are_untouched_bit_for_bit() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 5
    top_k = apply_top_k(logits, torch.tensor([0, 5, 50]), max_k=5)
    top_p = apply_top_p(logits, torch.tensor([1.0, 0.3, 1.0]))
    min_p = apply_min_p(logits, torch.tensor([0.0, 0.3, 0.0]))
    for out in (top_k, top_p, min_p):
        assert torch.equal(out[[0, 2]], logits[[0, 2]])
        assert len(kept(out[1])) < 50


def slow_top_k(row: list[float], k: int) -> set[int]:
    kth = sorted(row, reverse=True)[k - 1]
    return {i for i, x in enumerate(row) if x >= kth}


def slow_top_p(probs: list[float], p: float) -> tuple[set[int], float]:
    """Reference kept set, and how close any token's mass-before came to p (0 = ambiguous)."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    mass, keep, margin = 0.0, [], math.inf
    for i in order:
        margin = min(margin, abs(mass - p))
        if mass < p:
            keep.append(i)
        mass += probs[i]
    least = min(probs[i] for i in keep)
    return {i for i, q in enumerate(probs) if q >= least}, margin


logit_rows = st.lists(
    st.floats(-8, 8, allow_nan=False, width=32).map(lambda x: round(x, 2)), min_size=1, max_size=24
)


@settings(max_examples=200, deadline=None)
@given(row=logit_rows, k=st.integers(1, 30))
def test_top_k_matches_reference(row: list[float], k: int) -> None:
    logits = torch.tensor([row])
    out = apply_top_k(logits, torch.tensor([k]), max_k=k)
    assert kept(out[0]) == (set(range(len(row))) if k >= len(row) else slow_top_k(row, k))


@settings(max_examples=200, deadline=None)
@given(row=logit_rows, p=st.floats(0.01, 1.0))
def test_top_p_matches_reference(row: list[float], p: float) -> None:
    logits = torch.tensor([row])
    probs = torch.tensor([row], dtype=torch.float64).softmax(-1)[0].tolist()
    expected, margin = slow_top_p(probs, p)
    assume(p == 1.0 or margin > 1e-4)  # float32 cumsum may round either way at the boundary
    out = apply_top_p(logits, torch.tensor([p]))
    assert kept(out[0]) == (set(range(len(row))) if p == 1.0 else expected)


# --- penalties and min_tokens -------------------------------------------------------------------


def test_repetition_penalty_divides_positive_multiplies_negative() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, -1.0], [2.0, -2.0, 1.0, 0.5, -1.0]])
    params = SamplingParams(repetition_penalty=2.0)
    states = [state(params, prompt_token_ids=[0], output_token_ids=[1, 1]), state()]
    apply_penalties(logits, states, rows=[0])
    assert logits[0].tolist() == [1.0, -4.0, 1.0, 0.5, -1.0]  # prompt and output both count
    assert logits[1].tolist() == [2.0, -2.0, 1.0, 0.5, -1.0]  # row not listed: untouched


def test_presence_and_frequency_penalise_output_tokens_only() -> None:
    logits = torch.zeros(1, 5)
    params = SamplingParams(presence_penalty=1.0, frequency_penalty=0.5)
    states = [state(params, prompt_token_ids=[0, 4], output_token_ids=[2, 2, 3, 2])]
    apply_penalties(logits, states, rows=[0])
    # token 2: 3 times -> 0.5 * 3 + 1; token 3: once -> 0.5 + 1; prompt tokens 0, 4 untouched
    assert logits[0].tolist() == [0.0, 0.0, -2.5, -1.5, 0.0]


def test_all_penalties_compose() -> None:
    logits = torch.tensor([[4.0, -1.0, 3.0]])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    apply_penalties(logits, [state(params, prompt_token_ids=[1], output_token_ids=[0, 0])], [0])
    assert logits[0].tolist() == [4.0 / 2 - 0.5 - 0.5, -2.0, 3.0]


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    params = SamplingParams(min_tokens=2, stop_token_ids=[3])
    young = state(params, output_token_ids=[1], eos_token_ids=(0,))
    grown = state(params, output_token_ids=[1, 1], eos_token_ids=(0,))
    no_eos = state(dataclasses.replace(params, ignore_eos=True), eos_token_ids=(0,))
    logits = torch.zeros(3, 5)
    apply_min_tokens(logits, [young, grown, no_eos])
    assert [kept(row) for row in logits] == [{1, 2, 4}, {0, 1, 2, 3, 4}, {0, 1, 2, 4}]


def test_sampler_min_tokens_blocks_eos_for_greedy() -> None:
    logits = torch.tensor([[5.0, 1.0, 2.0]] * 2)  # EOS (0) is the argmax
    params = SamplingParams(temperature=0, min_tokens=3)
    states = [
        state(params, output_token_ids=[1, 1], eos_token_ids=(0,)),
        state(params, output_token_ids=[1, 1, 1], eos_token_ids=(0,)),
    ]
    assert Sampler()(logits, states).token_ids == [2, 0]


def test_sampler_applies_penalties_before_greedy_argmax() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]] * 2)
    states = [
        state(SamplingParams(temperature=0, presence_penalty=0.5), output_token_ids=[0]),
        state(SamplingParams(temperature=0), output_token_ids=[0]),
    ]
    assert Sampler()(logits, states).token_ids == [1, 0]


# --- the sampler --------------------------------------------------------------------------------


def test_greedy_is_argmax_and_ignores_truncation() -> None:
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0, top_p=0.1, top_k=3, min_p=0.5)
    out = Sampler()(logits, [state(params) for _ in range(16)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None and out.top_logprobs is None


def test_sampler_leaves_logits_unmodified() -> None:
    logits = torch.randn(2, 10)
    before = logits.clone()
    params = SamplingParams(top_k=2, repetition_penalty=3.0, temperature=0.5)
    Sampler()(logits, [state(params, prompt_token_ids=[1, 2]), state()])
    assert torch.equal(logits, before)


def test_shape_mismatch_is_rejected() -> None:
    with pytest.raises(ValueError, match="logits must be"):
        Sampler()(torch.zeros(2, 4), [state()])


def sample_fraction(params: SamplingParams, probs: tuple[float, ...], n: int = 4000) -> float:
    """Fraction of token 0 over n unseeded rows sampled in one batch."""
    sampler = Sampler(generator=torch.Generator().manual_seed(1234))
    logits = log_probs(*probs).repeat(n, 1)
    tokens = torch.tensor(sampler(logits, [state(params) for _ in range(n)]).token_ids)
    return (tokens == 0).float().mean().item()


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(), 0.8),
        (SamplingParams(temperature=2.0), 2 / 3),  # p ∝ sqrt(p): sqrt(.8) / (sqrt(.8) + sqrt(.2))
        (SamplingParams(temperature=0.5), 0.8**2 / (0.8**2 + 0.2**2)),
        (SamplingParams(top_p=0.7), 1.0),
        (SamplingParams(min_p=0.3), 1.0),
        (SamplingParams(top_k=1), 1.0),
    ],
)
def test_unseeded_sampling_distribution(params: SamplingParams, expected: float) -> None:
    # 4000 draws: standard error <= 0.008, so 0.03 is about 4 sigma
    assert abs(sample_fraction(params, (0.8, 0.2)) - expected) < 0.03


def test_seeded_distribution_over_seeds() -> None:
    logits = log_probs(0.8, 0.2).repeat(4000, 1)
    states = [state(SamplingParams(seed=s)) for s in range(4000)]
    tokens = torch.tensor(Sampler()(logits, states).token_ids)
    assert abs((tokens == 0).float().mean().item() - 0.8) < 0.03


def run_steps(target: SamplingParams, others: list[SamplingParams], steps: int = 12) -> list[int]:
    """Sample `steps` tokens for a request with `target`, batched at position 1 among `others`."""
    vocab, position = 64, min(1, len(others))
    mine_model = torch.Generator().manual_seed(7)  # fake model: the target's logits per step
    others_model = torch.Generator().manual_seed(8)
    torch.manual_seed(len(others))  # the default generator differs between compositions
    states = [state(p, prompt_token_ids=[1, 2, 3], eos_token_ids=(0,)) for p in others]
    mine = state(target, prompt_token_ids=[1, 2, 3], eos_token_ids=(0,))
    states.insert(position, mine)
    sampler = Sampler()
    for _ in range(steps):
        logits = torch.randn(len(states), vocab, generator=others_model) * 3
        logits[position] = torch.randn(vocab, generator=mine_model) * 3
        out = sampler(logits, states)
        for s, token in zip(states, out.token_ids, strict=True):
            s.output_token_ids.append(token)
    return mine.output_token_ids


SEEDED = SamplingParams(seed=42, temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.1)
COMPOSITIONS = [
    [],
    [SamplingParams()],
    [SamplingParams(temperature=0), SamplingParams(seed=1, min_p=0.2)],
    [SamplingParams(top_k=3), SamplingParams(top_p=0.3, presence_penalty=1.0), SamplingParams()],
    [SamplingParams(seed=42), SamplingParams(logprobs=5, min_tokens=4, frequency_penalty=-1.0)],
]


def test_seeded_request_is_independent_of_its_batch() -> None:
    alone = run_steps(SEEDED, [])
    for others in COMPOSITIONS[1:]:
        assert run_steps(SEEDED, others) == alone
    # the batch's random rows really are random, and the seed matters
    assert run_steps(dataclasses.replace(SEEDED, seed=43), []) != alone
    assert len(set(alone)) > 3


def test_unseeded_request_depends_on_the_shared_generator() -> None:
    unseeded = dataclasses.replace(SEEDED, seed=None)
    assert run_steps(unseeded, COMPOSITIONS[1]) != run_steps(unseeded, COMPOSITIONS[3])


# --- logprobs -----------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_of_the_sampled_token() -> None:
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(3))
    params = [
        SamplingParams(logprobs=0, temperature=0.3, repetition_penalty=2.0, top_k=5),
        SamplingParams(logprobs=4, temperature=0, presence_penalty=2.0),
        SamplingParams(),
    ]
    states = [state(p, prompt_token_ids=[0, 1], output_token_ids=[2]) for p in params]
    out = Sampler()(logits, states)
    raw = logits.log_softmax(-1)
    expected = raw[torch.arange(3), torch.tensor(out.token_ids)]
    assert out.logprobs == pytest.approx(expected.tolist(), abs=1e-6)
    assert out.top_logprobs is not None
    assert out.top_logprobs[0] == [] and out.top_logprobs[2] == []
    top = out.top_logprobs[1]
    assert [t for t, _ in top] == raw[1].topk(4).indices.tolist()
    assert [lp for _, lp in top] == pytest.approx(raw[1].topk(4).values.tolist(), abs=1e-6)
    assert all(a[1] >= b[1] for a, b in zip(top, top[1:], strict=False))


def test_top_logprobs_hand_made() -> None:
    logits = log_probs(0.1, 0.6, 0.3)
    out = Sampler()(logits, [state(SamplingParams(temperature=0, logprobs=2))])
    assert out.token_ids == [1]
    assert out.logprobs == pytest.approx([math.log(0.6)])
    assert out.top_logprobs is not None
    assert [t for t, _ in out.top_logprobs[0]] == [1, 2]
    assert [lp for _, lp in out.top_logprobs[0]] == pytest.approx([math.log(0.6), math.log(0.3)])
