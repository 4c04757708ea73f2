"""The near-tie rule of the GPU check's greedy-token comparisons (``token_agreement``)."""

from __future__ import annotations

import pytest
import torch
from token_agreement import compare_greedy, first_divergence, judge_flip


def test_first_divergence() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([], []) is None
    with pytest.raises(ValueError, match="different lengths"):
        first_divergence([1, 2], [1])


def test_judge_flip_measures_margin_and_the_worse_pick() -> None:
    logits = torch.tensor([0.0, 5.0, 4.96, 3.0])
    margin, gap, near = judge_flip(logits, 1, 2, tol=0.1)
    assert margin == pytest.approx(0.04) and gap == pytest.approx(0.04) and near
    margin, gap, near = judge_flip(logits, 2, 1, tol=0.01)  # same race, tighter tolerance
    assert gap == pytest.approx(0.04) and not near
    margin, gap, near = judge_flip(logits, 1, 3, tol=0.1)  # one side picked a clear loser
    assert margin == pytest.approx(0.04) and gap == pytest.approx(2.0) and not near
    margin, gap, near = judge_flip(logits, 2, 3, tol=5.0)  # neither is the best: worse counts
    assert gap == pytest.approx(2.0) and near
    assert judge_flip(logits, 1, 2, tol=None)[2] is False  # exact mode: never a near-tie


def test_compare_greedy_asks_the_reference_at_the_agreed_prefix() -> None:
    asked: list[tuple[int, list[int]]] = []

    def next_logits(prompt: int, prefix: list[int]) -> torch.Tensor:
        asked.append((prompt, prefix))
        return torch.tensor([1.0, 1.02, 0.0, -3.0]) if prompt == 0 else torch.tensor(
            [0.0, 0.0, 9.0, 1.0])

    ours = [[3, 7, 1, 5], [2, 2], [4]]
    theirs = [[3, 7, 0, 6], [2, 3], [4]]
    out = compare_greedy(ours, theirs, next_logits, tol=0.05)
    assert asked == [(0, [3, 7]), (1, [2])]
    assert (out["equal"], out["of"], out["near_tie_flips"]) == (1, 3, 1)
    first, second = out["divergences"]
    assert (first["prompt"], first["position"], first["ours"], first["theirs"]) == (0, 2, 1, 0)
    assert first["near_tie"] and first["gap"] == pytest.approx(0.02)
    assert first["margin"] == pytest.approx(0.02)
    assert not second["near_tie"] and second["gap"] == pytest.approx(8.0)  # 9 vs 1
    assert not out["ok"]  # one clear divergence fails the comparison


def test_compare_greedy_passes_equal_and_near_tie_only() -> None:
    flat = lambda prompt, prefix: torch.tensor([2.0, 2.03, -1.0])  # noqa: E731
    assert compare_greedy([[0, 1]], [[0, 1]], flat, tol=None)["ok"]
    out = compare_greedy([[0, 1]], [[0, 0]], flat, tol=0.05)
    assert out["ok"] and out["near_tie_flips"] == 1
    exact = compare_greedy([[0, 1]], [[0, 0]], flat, tol=None)
    assert not exact["ok"] and exact["divergences"][0]["margin"] == pytest.approx(0.03)
