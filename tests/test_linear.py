"""Packed linears (MKL, oneDNN): same results as F.linear up to float reassociation; the bias
is never written; the backend choice and its errors."""

from __future__ import annotations

import pytest
import torch
from skip_policy import require, require_mkl
from torch import nn

from vmkv.models import linear as linear_module
from vmkv.models.linear import (
    PackedLinear,
    mkl_available,
    onednn_available,
    pack_linears,
    resolve_backend,
)


def require_onednn() -> None:
    """oneDNN is in every CPU wheel of torch: fail where it is missing."""
    require(onednn_available, "oneDNN in torch", lambda: f"torch {torch.__version__} was "
            "built without it: install the pinned CPU wheel (make setup)")


REQUIRE = {"mkl": require_mkl, "onednn": require_onednn}


@pytest.mark.parametrize("backend", list(REQUIRE))
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 7, 64, 300])
def test_packed_linear_matches_f_linear(backend: str, bias: bool, rows: int) -> None:
    REQUIRE[backend]()
    torch.manual_seed(rows)
    linear = nn.Linear(96, 40, bias=bias)
    packed = PackedLinear(linear, 64, backend)
    x = torch.randn(rows, 96)
    strided = torch.randn(rows, 200)[:, 10:106]  # rows 200 floats apart
    for _ in range(2):  # a second call sees the same bias (an output never aliases it)
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed(strided), linear(strided), rtol=1e-5, atol=1e-5)


def test_pack_linears_swaps_cpu_float32_layers_only() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4)),
                          nn.Linear(4, 4).to(torch.float64))
    assert pack_linears(model, "torch") == 0
    require_onednn()  # so "auto" packs with one of the two
    assert pack_linears(model) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[2][0], PackedLinear)
    assert model[0].backend == resolve_backend("auto")
    assert isinstance(model[3], nn.Linear)  # float64 stays
    with pytest.raises(ValueError, match="linear_backend must be one of"):
        pack_linears(model, "blas")


@pytest.mark.parametrize("vendor", ["GenuineIntel", "AuthenticAMD"])
def test_auto_takes_mkl_on_intel_and_onednn_elsewhere(vendor: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear_module, "cpu_vendor", lambda: vendor)
    if vendor == "GenuineIntel" and mkl_available():
        want = "mkl"
    else:
        want = ("onednn" if onednn_available() else "mkl" if mkl_available() else "torch")
    assert resolve_backend("auto") == want
    with pytest.raises(ValueError, match="PackedLinear backend must be one of"):
        PackedLinear(nn.Linear(4, 4), 64, "torch")


def test_a_backend_this_torch_lacks_is_a_value_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear_module, "mkl_available", lambda: False)
    with pytest.raises(ValueError, match="linear_backend='mkl' needs torch built with MKL"):
        PackedLinear(nn.Linear(4, 4), 64, "mkl")
    with pytest.raises(ValueError, match="linear_backend='mkl' needs torch built with MKL"):
        pack_linears(nn.Sequential(nn.Linear(4, 4)), "mkl")
