"""Verification keeps the target distribution exactly (vmkv/spec_decode/verifier.py): with a
point-mass draft (ngram, suffix) sampling the target and accepting when the token equals the
proposal is vLLM's rejection sampler (accept d with probability p(d); on rejection draw from p
without d, renormalised). Measured here: many sequences verify the same proposals over fixed
target logits with the engine's sampler, and the emitted tokens' frequencies at each position
match the target distributions (chi-square, a 1e-4 false-alarm rate per comparison)."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from vmkv.sampling import Sampler, SamplingState
from vmkv.sampling_params import SamplingParams
from vmkv.spec_decode.verifier import verify

V = 6
#: chi-square quantiles at 1 - 1e-4 by degrees of freedom
CHI2 = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74}


def target(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the sampler draws from for one row: temperature, then top-k."""
    scaled = logits / params.temperature
    if 0 < params.top_k < V:
        cut = scaled.topk(params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < cut, float("-inf"))
    return scaled.softmax(-1)


def chi_square(counts: Counter[int], probs: torch.Tensor) -> tuple[float, int]:
    total = sum(counts.values())
    support = [t for t in range(V) if probs[t] > 0]
    assert all(t in support for t in counts), "a token outside the target's support"
    stat = sum((counts.get(t, 0) - total * float(probs[t])) ** 2 / (total * float(probs[t]))
               for t in support)
    return stat, len(support) - 1


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, max_tokens=10),
                                    SamplingParams(temperature=0.6, top_k=4, max_tokens=10)])
def test_verification_keeps_the_target_distribution(params: SamplingParams) -> None:
    torch.manual_seed(0)
    rows = torch.randn(3, V) * 1.5  # the target's logits after the last token, d1, d1 d2
    drafts = [int(rows[0].argmax()), int(rows[1].argsort()[-2])]  # likely, then less likely
    sampler = Sampler(torch.Generator().manual_seed(1))
    runs: list[list[int]] = []

    def append(seq: SimpleNamespace, token: int, lp: float | None, top: object) -> bool:
        seq.sampling_state.output_token_ids.append(token)
        return False

    n = 4000
    for _ in range(5):
        seqs = [SimpleNamespace(sampling_state=SamplingState(params), draft_token_ids=drafts)
                for _ in range(n)]
        logits = rows.repeat(n, 1)  # [n * 3, V]: each sequence's three rows
        counts = verify(sampler, logits, [(s, 3 * i) for i, s in enumerate(seqs)], append)
        assert all(1 <= c <= 3 for c in counts)
        runs += [s.sampling_state.output_token_ids for s in seqs]
    first = Counter(r[0] for r in runs)
    second = Counter(r[1] for r in runs if r[0] == drafts[0])
    third = Counter(r[2] for r in runs if r[:2] == drafts)
    assert all(len(r) == 1 for r in runs if r[0] != drafts[0])  # a rejection ends the run
    for counts, row in ((first, 0), (second, 1), (third, 2)):
        stat, df = chi_square(counts, target(rows[row], params))
        assert stat < CHI2[df], (row, stat, counts)
    p = [target(rows[i], params) for i in range(2)]  # acceptance as the formula says
    assert len(second) and sum(second.values()) / len(runs) == pytest.approx(
        float(p[0][drafts[0]]), abs=0.02)
    assert sum(third.values()) / len(runs) == pytest.approx(
        float(p[0][drafts[0]] * p[1][drafts[1]]), abs=0.02)


def test_greedy_takes_the_longest_matching_prefix_and_the_bonus() -> None:
    rows = torch.eye(V)[[2, 3, 1, 5]] * 5  # argmax 2, 3, 1, 5
    sampler, got = Sampler(), []
    seq = SimpleNamespace(sampling_state=SamplingState(SamplingParams(temperature=0.0)),
                          draft_token_ids=[2, 3, 4])
    counts = verify(sampler, rows, [(seq, 0)], lambda s, t, lp, top: got.append(t) or False)
    assert (counts, got) == ([3], [2, 3, 1])  # d1, d2 accepted, d3 rejected: 1 instead
    got.clear()
    seq.draft_token_ids = [2, 3, 1]
    assert verify(sampler, rows, [(seq, 0)], lambda s, t, lp, top: got.append(t) or False
                  ) == [4] and got == [2, 3, 1, 5]  # all accepted + the bonus
