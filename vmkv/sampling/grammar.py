"""The structured-output mask: one token bitmask per step for the constrained rows.

Every constrained row's matcher writes its allowed next tokens into one shared
``[R, ceil(V / 32)]`` int32 bitmask (a bit per token), and xgrammar's kernel sets every other
logit of those rows to -inf in place, in one call. Unconstrained rows are not touched.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vmkv.sampling.state import SamplingState


def constrained_rows(states: Sequence[SamplingState]) -> list[int]:
    """Indices of the rows whose sequence has a grammar that applies now (not one waiting
    for the end of a reasoning section)."""
    return [i for i, s in enumerate(states) if s.grammar is not None and s.grammar.is_active]


def apply_grammar_bitmask(logits: torch.Tensor, states: Sequence[SamplingState],
                          rows: list[int]) -> None:
    """Mask ``logits: [B, V]`` (float32, in place) so each row in ``rows`` can only sample a
    token its grammar allows next."""
    if not rows:
        return
    import xgrammar as xgr  # only once a constrained request exists (see structured/compiler.py)

    bitmask = xgr.allocate_token_bitmask(len(logits), logits.shape[-1])  # [B, ceil(V / 32)]
    for i in rows:
        states[i].grammar.fill_bitmask(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
