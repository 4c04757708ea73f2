"""oneDNN-packed linears: same results as F.linear up to float reassociation; opt-out works."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vmkv.models.linear import PackedLinear, onednn_available, pack_linears

pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch without oneDNN")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_linear_matches_f_linear(bias: bool, rows: int) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(96, 40, bias=bias)
    x = torch.randn(rows, 96)
    torch.testing.assert_close(PackedLinear(linear, 64)(x), linear(x), rtol=1e-5, atol=1e-5)


def test_pack_linears_swaps_cpu_float32_layers_only() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4)),
                          nn.Linear(4, 4).to(torch.float64))
    assert pack_linears(model, "torch") == 0
    assert pack_linears(model) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[2][0], PackedLinear)
    assert isinstance(model[3], nn.Linear)  # float64 stays
    with pytest.raises(ValueError, match="linear_backend must be one of"):
        pack_linears(model, "blas")
