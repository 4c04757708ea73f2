"""Random sampling's inverse-CDF draw (``cpu_argmax.sample_rows``, csrc/cpu_argmax.cpp): the
kernel and its torch fallback draw the same tokens for the same uniforms (up to float rounding
at interval edges), follow softmax(logits / T) (a chi-square test), never draw a -inf token,
and reject bad arguments with a precise message."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from skip_policy import require_cpu_kernel

from vmkv.kernels import cpu_argmax
from vmkv.kernels.cpu_argmax import _sample_rows_torch, sample_rows

#: chi-square's 0.999 quantile at 9 degrees of freedom: a correct sampler fails 1 run in 1,000
CHI2_9_999 = 27.88


@pytest.fixture(autouse=True, scope="module")
def _built() -> None:
    """A library that did not build fails every test here, with the compiler's output."""
    require_cpu_kernel(cpu_argmax)


def uniforms(n: int, seed: int) -> torch.Tensor:
    return torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rows,vocab", [(64, 49152), (4, 262144), (7, 65), (3, 1)])
def test_kernel_draws_what_the_torch_reference_draws(rows: int, vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(rows, vocab, generator=g) * 3  # logits: [rows, vocab]
    temperature = torch.rand(rows, generator=g) + 0.3
    agree = total = 0
    for seed in range(50):
        u = uniforms(rows, seed)
        picks = sample_rows(logits, temperature, u)
        agree += int((picks == _sample_rows_torch(logits, temperature, u)).sum())
        total += rows
    assert agree / total >= 0.99  # only draws within ~1e-7 of an interval's edge may differ


@pytest.mark.parametrize("draw", [sample_rows, _sample_rows_torch])
def test_draws_follow_the_tempered_softmax(draw) -> None:
    logits = torch.randn(1, 10, generator=torch.Generator().manual_seed(3))
    n, temperature = 100_000, 0.7
    picks = draw(logits.expand(n, 10), torch.full((n,), temperature), uniforms(n, 4))
    expected = n * (logits[0].double() / temperature).softmax(-1)
    counts = torch.bincount(picks, minlength=10).double()
    assert float(((counts - expected) ** 2 / expected).sum()) < CHI2_9_999


@settings(max_examples=40, deadline=None)
@given(vocab=st.integers(1, 300), seed=st.integers(0, 2**31 - 1))
def test_masked_tokens_are_never_drawn(vocab: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(8, vocab, generator=g)
    logits[torch.rand(8, vocab, generator=g) < 0.7] = -float("inf")
    logits[:, torch.randint(0, vocab, (1,), generator=g)] = 0.0  # each row keeps one token
    u = torch.cat([torch.tensor([0.0, 1 - 2**-53], dtype=torch.float64), uniforms(6, seed)])
    for draw in (sample_rows, _sample_rows_torch):
        picks = draw(logits, torch.full((8,), 0.5), u)
        assert bool(torch.isfinite(logits.gather(1, picks[:, None])).all())


def test_dead_rows_and_nans_pick_what_argmax_picks() -> None:
    logits = torch.randn(3, 200, generator=torch.Generator().manual_seed(5))
    logits[0] = -float("inf")  # nothing to draw: index 0, as argmax
    logits[1, 150] = logits[1, 40] = float("nan")  # the first NaN, as argmax
    for draw in (sample_rows, _sample_rows_torch):
        picks = draw(logits, torch.ones(3), uniforms(3, 6))
        assert picks[:2].tolist() == [0, 40]


def test_strided_rows() -> None:
    base = torch.randn(5, 300, generator=torch.Generator().manual_seed(7))
    view = base[:, :257]  # row stride 300 > 257 columns
    assert cpu_argmax._takes(view)
    u = torch.full((5,), 0.5, dtype=torch.float64)
    assert torch.equal(sample_rows(view, torch.ones(5), u),
                       sample_rows(view.contiguous(), torch.ones(5), u))


@pytest.mark.parametrize("temperature,u,message", [
    (torch.zeros(2), torch.full((2,), 0.5, dtype=torch.float64), "each > 0"),
    (torch.ones(2), torch.tensor([0.5, 1.0], dtype=torch.float64), "in \\[0, 1\\)"),
    (torch.ones(3), torch.full((2,), 0.5, dtype=torch.float64), "must be \\[2\\]"),
])
def test_bad_arguments_are_refused(temperature: torch.Tensor, u: torch.Tensor,
                                   message: str) -> None:
    with pytest.raises(ValueError, match=message):
        sample_rows(torch.randn(2, 10), temperature, u)
