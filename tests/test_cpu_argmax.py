"""The CPU argmax kernel (csrc/cpu_argmax.cpp) gives torch.argmax's answer on every row:
first maximum on ties, first NaN when a row has one, all -inf rows, strided rows."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from skip_policy import require_cpu_kernel

from vmkv.kernels import cpu_argmax


@pytest.fixture(autouse=True, scope="module")
def _built() -> None:
    """A library that did not build fails every test here, with the compiler's output."""
    require_cpu_kernel(cpu_argmax)


def check(logits: torch.Tensor) -> None:
    assert cpu_argmax._takes(logits)
    assert torch.equal(cpu_argmax.argmax_rows(logits), logits.argmax(dim=-1))


def test_random_rows_of_a_vocabulary() -> None:
    check(torch.randn(64, 49152, generator=torch.Generator().manual_seed(0)))


def test_ties_nan_and_infinities_pick_what_torch_picks() -> None:
    x = torch.randn(8, 1000, generator=torch.Generator().manual_seed(1))
    x[0, 5] = x[0, 900] = x[0].max() + 1  # tie: the first
    x[1, 7] = x[1, 3] = float("nan")  # NaN wins, the first one
    x[2] = -float("inf")  # nothing larger than -inf: index 0
    x[3, 999] = x[3, 998] = float("inf")
    x[4, 0] = float("nan")
    x[5, 999] = float("nan")
    x[6, 63] = x[6, 64] = 1e30  # across the kernel's block boundary
    check(x)


def test_strided_rows_and_small_shapes() -> None:
    base = torch.randn(5, 300, generator=torch.Generator().manual_seed(2))
    check(base[:, :257])  # row stride 300 > 257 columns
    check(base[:1, :1])
    check(torch.empty(0, 7))


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 6), cols=st.integers(1, 200), seed=st.integers(0, 2**31 - 1),
       levels=st.integers(1, 4))
def test_few_distinct_values_tie_like_torch(rows: int, cols: int, seed: int, levels: int) -> None:
    g = torch.Generator().manual_seed(seed)
    check(torch.randint(0, levels, (rows, cols), generator=g).float())


def test_other_inputs_go_to_torch() -> None:
    for logits in (torch.randn(3, 10, dtype=torch.float64), torch.randn(10, 3).t(),
                   torch.randn(10)):
        assert not cpu_argmax._takes(logits)
    x = torch.randn(3, 10, dtype=torch.float64)
    assert torch.equal(cpu_argmax.argmax_rows(x), x.argmax(dim=-1))
