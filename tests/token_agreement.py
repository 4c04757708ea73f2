"""Greedy-token agreement with a reference model, honest about near-ties (no pytest: the GPU
check imports it).

Two greedy decodes of one prompt agree up to the first position where they pick different
tokens; after it they condition on different text and say nothing more. At that position the
reference model's next-token logits (prompt + the agreed tokens) tell a rounding flip from a
real disagreement:

    margin = top1 - top2 of the reference logits             (how close the race was)
    gap    = top1 - min(logit[ours], logit[theirs])          (how far the worse pick is)
    near-tie flip  <=>  gap <= tol                           (both picks within tol of the best)

A near-tie flip passes; a divergence whose gap exceeds ``tol`` fails. ``tol=None`` is exact
equality (float32): every divergence fails, its margin and gap are still reported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

#: ``(prompt index, agreed generated tokens) -> [vocab]`` next-token logits of the reference
NextLogits = Callable[[int, list[int]], torch.Tensor]


@dataclass(frozen=True)
class Divergence:
    """The first position where two greedy decodes of prompt ``prompt`` differ."""

    prompt: int
    position: int
    ours: int
    theirs: int
    margin: float
    gap: float
    near_tie: bool


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token of two equally long sequences, None if equal."""
    if len(a) != len(b):
        raise ValueError(f"sequences of different lengths ({len(a)} vs {len(b)})")
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def judge_flip(logits: torch.Tensor, ours: int, theirs: int, tol: float | None
               ) -> tuple[float, float, bool]:
    """``(margin, gap, near_tie)`` of picking ``ours`` vs ``theirs`` under reference
    ``logits [vocab]`` (see the module docstring); never a near-tie when ``tol`` is None."""
    logits = logits.float().flatten()
    top2 = torch.topk(logits, 2).values
    margin = float(top2[0] - top2[1])
    gap = float(top2[0] - torch.minimum(logits[ours], logits[theirs]))
    return margin, gap, tol is not None and gap <= tol


def compare_greedy(ours: list[list[int]], theirs: list[list[int]], next_logits: NextLogits,
                   tol: float | None) -> dict[str, Any]:
    """Compare greedy outputs prompt by prompt; ``next_logits`` is called once per divergent
    prompt. Returns ``ok`` (equal or only near-tie flips), counts and every divergence."""
    if len(ours) != len(theirs):
        raise ValueError(f"{len(ours)} vs {len(theirs)} prompts")
    found = []
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        pos = first_divergence(a, b)
        if pos is None:
            continue
        margin, gap, near = judge_flip(next_logits(i, a[:pos]), a[pos], b[pos], tol)
        found.append(Divergence(i, pos, a[pos], b[pos], margin, gap, near))
    return {"ok": all(d.near_tie for d in found), "equal": len(ours) - len(found),
            "of": len(ours), "near_tie_flips": sum(d.near_tie for d in found),
            "divergences": [asdict(d) for d in found]}
