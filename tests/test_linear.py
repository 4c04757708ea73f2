"""Packed linears (MKL, oneDNN; brgemm in bfloat16): same results as F.linear up to float
reassociation; the bias is never written; the backend choice and its errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from skip_policy import require, require_bf16_kernels, require_f32_brgemm, require_mkl
from torch import nn

from vmkv.kernels import cpu_bf16
from vmkv.models import huge_pages
from vmkv.models import linear as linear_module
from vmkv.models.linear import (
    PackedLinear,
    mkl_available,
    onednn_available,
    pack_linears,
    resolve_backend,
)
from vmkv.models.quant.gguf_weights import describe_weights, weight_bytes


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


@pytest.mark.parametrize("backend", list(REQUIRE))
def test_resident_bytes_count_every_packed_layout(backend: str) -> None:
    """The start-up report's resident bytes read every packed weight, oneDNN's opaque layout
    included (it has no storage to ask: the engine's start-up crashed on AVX2 CPUs, where
    ``auto`` packs with oneDNN)."""
    REQUIRE[backend]()
    linear = nn.Linear(96, 40)
    packed = PackedLinear(linear, 64, backend)
    assert weight_bytes(packed) >= (96 * 40 + 40) * 4
    assert "MB resident" in describe_weights(nn.Sequential(packed))


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
def test_auto_takes_mkl_on_intel_and_brgemm_or_onednn_elsewhere(
        vendor: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear_module, "cpu_vendor", lambda: vendor)
    if vendor == "GenuineIntel" and mkl_available():
        want = "mkl"
    elif cpu_bf16.available(torch.float32):
        want = "brgemm"
    else:
        want = ("onednn" if onednn_available() else "mkl" if mkl_available() else "torch")
    assert resolve_backend("auto") == want
    with pytest.raises(ValueError, match="PackedLinear backend must be one of"):
        PackedLinear(nn.Linear(4, 4), 64, "torch")


def test_bfloat16_on_an_avx2_cpu_runs_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN refuses to pack a bfloat16 weight without AVX-512 BW/VL/DQ (or AVX-NE-CONVERT):
    there ``auto`` leaves bfloat16 linears to F.linear and ``onednn`` is a ValueError."""
    avx2 = "sse2 avx avx2 fma f16c"
    monkeypatch.setattr(linear_module, "cpu_features", lambda: avx2)
    monkeypatch.setattr(cpu_bf16, "available", lambda dtype=torch.bfloat16: False)
    assert resolve_backend("auto", torch.bfloat16) == "torch"
    with pytest.raises(ValueError, match="cannot pack bfloat16 here.*choose torch"):
        resolve_backend("onednn", torch.bfloat16)
    model = nn.Sequential(nn.Linear(8, 8)).to(torch.bfloat16)
    assert pack_linears(model) == 0 and isinstance(model[0], nn.Linear)
    monkeypatch.setattr(linear_module, "cpu_features", lambda: f"{avx2} avx512bw avx512vl avx512dq")
    assert resolve_backend("auto", torch.bfloat16) == ("onednn" if onednn_available() else "torch")


def test_a_backend_this_torch_lacks_is_a_value_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear_module, "mkl_available", lambda: False)
    with pytest.raises(ValueError, match="linear_backend='mkl' needs torch built with MKL"):
        PackedLinear(nn.Linear(4, 4), 64, "mkl")
    with pytest.raises(ValueError, match="linear_backend='mkl' needs torch built with MKL"):
        pack_linears(nn.Sequential(nn.Linear(4, 4)), "mkl")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("rows", "inp", "out"), [(0, 576, 960), (1, 576, 960), (7, 40, 50),
                                                   (45, 576, 576), (64, 1536, 576),
                                                   (300, 576, 3072)])
def test_brgemm_rounds_like_f_linear_in_bfloat16(bias: bool, rows: int, inp: int,
                                                 out: int) -> None:
    """bf16 results rounded once, as F.linear's (which accumulates in float32 too): equal but
    for the rare element whose float32 sums straddle a rounding boundary (then 1 bf16 ulp);
    the float32 output (the LM head's) is the exact product up to summation order. Covers one
    row tile and several (decode, prefill), decode rows split where the column blocks do not
    divide over the threads (45 rows, 9 blocks), a partial last column block and odd shapes."""
    require_bf16_kernels()
    torch.manual_seed(rows + out)
    linear = nn.Linear(inp, out, bias=bias).to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(rows, inp).to(torch.bfloat16)
    packed = PackedLinear(linear, 64, "brgemm")
    want = nn.functional.linear(x, linear.weight, linear.bias)
    got = packed(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out)
    assert int((got != want).sum()) <= 1e-3 * got.numel()
    torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-2)
    exact = x.float() @ linear.weight.float().T + (linear.bias.float() if bias else 0)
    head = PackedLinear(linear, 64, "brgemm", out_dtype=torch.float32)
    torch.testing.assert_close(head(x), exact, rtol=1e-4, atol=1e-4)
    strided = torch.randn(rows, 2 * inp).to(torch.bfloat16)[:, ::2]  # row stride != width
    assert torch.equal(packed(strided), packed(strided.contiguous()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("inp", "out"), [(576, 960), (1536, 576), (64, 96), (40, 50)])
def test_decode_rows_equal_the_prefill_tiles_bit_for_bit(dtype: torch.dtype, inp: int,
                                                         out: int) -> None:
    """Row tiles of up to 64 rows (decode) stream each column block through vmkv's own loops,
    larger tiles (prefill) go through the ukernel; without AMX both are the same AVX-512
    arithmetic in the same order, so any rows of a decode batch give the prefill product's
    values bit for bit (with AMX the tiles accumulate differently: float tolerance). Block
    widths 64, 32 and a padded 64; passes of 6 rows and their remainders; rows split over the
    threads where the column blocks do not divide (13 and 33 rows of 9 or 15 blocks)."""
    from vmkv.cpu_info import cpu_features

    if dtype == torch.bfloat16:
        require_bf16_kernels()
    else:
        require_f32_brgemm()
    torch.manual_seed(inp + out)
    linear = nn.Linear(inp, out).to(dtype).requires_grad_(False)
    head = PackedLinear(linear, 64, "brgemm", out_dtype=torch.float32)
    x = torch.randn(300, inp).to(dtype)
    tiles = head(x)  # 300 rows: two tiles of 150, the ukernel's
    amx = dtype == torch.bfloat16 and "amx_bf16" in cpu_features().split()
    for rows in (1, 2, 3, 4, 5, 6, 7, 13, 33, 64):
        got = head(x[:rows])
        if amx:
            torch.testing.assert_close(got, tiles[:rows], rtol=1e-4, atol=1e-4)
        else:
            assert torch.equal(got, tiles[:rows]), rows


def test_bfloat16_backends_and_refusals() -> None:
    require_bf16_kernels()
    assert resolve_backend("auto", torch.bfloat16) == "brgemm"
    with pytest.raises(ValueError, match="float32 only"):
        resolve_backend("mkl", torch.bfloat16)
    model = nn.Sequential(nn.Linear(64, 64).to(torch.bfloat16))
    model.lm_head = nn.Linear(64, 100, bias=False).to(torch.bfloat16)
    assert pack_linears(model) == 2
    assert model[0].out_dtype == torch.bfloat16 and model.lm_head.out_dtype == torch.float32
    with pytest.raises(ValueError, match="a brgemm linear takes bfloat16 or float32"):
        model[0](torch.randn(3, 64).double())


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("rows", "inp", "out"), [(0, 576, 960), (1, 576, 960), (7, 40, 50),
                                                   (45, 576, 576), (64, 1536, 576),
                                                   (300, 576, 3072)])
def test_brgemm_float32_is_f_linear_up_to_summation_order(bias: bool, rows: int, inp: int,
                                                          out: int) -> None:
    """The float32 brgemm linear (plain column blocks, the ukernel's float overload): one row
    tile and several, decode rows split over the threads (45 rows, 9 blocks), a partial last
    column block, odd shapes, a strided input."""
    require_f32_brgemm()
    torch.manual_seed(rows + out)
    linear = nn.Linear(inp, out, bias=bias).requires_grad_(False)
    x = torch.randn(rows, inp)
    packed = PackedLinear(linear, 64, "brgemm")
    got = packed(x)
    assert got.dtype == torch.float32 and got.shape == (rows, out)
    torch.testing.assert_close(got, nn.functional.linear(x, linear.weight, linear.bias),
                               rtol=1e-4, atol=1e-4)
    strided = torch.randn(rows, 2 * inp)[:, ::2]  # row stride != width
    assert torch.equal(packed(strided), packed(strided.contiguous()))


def test_brgemm_weights_move_into_huge_pages_where_the_os_has_them(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Packed brgemm weights start on 2 MiB boundaries of one MADV_HUGEPAGE mapping where
    transparent huge pages are on (``madvise`` or ``always``), with the same results; where
    they are ``[never]`` the weights stay where packing put them."""
    require_f32_brgemm()
    torch.manual_seed(0)
    x = torch.randn(5, 96)
    for mode in ("always [madvise] never", "always madvise [never]"):
        thp = tmp_path / "enabled"
        thp.write_text(mode + "\n")
        monkeypatch.setattr(huge_pages, "THP_ENABLED", thp)
        model = nn.Sequential(nn.Linear(96, 40), nn.Linear(40, 96))
        want = model(x)
        assert pack_linears(model, "brgemm") == 2
        first, second = (m.packed_weight.data_ptr() for m in model)
        assert (first % huge_pages.HUGE_PAGE == 0) == ("[never]" not in mode)
        if "[never]" not in mode:  # one mapping, each weight on its own page
            size = model[0].packed_weight.numel() * model[0].packed_weight.element_size()
            assert second - first == -(-size // 4096) * 4096
        torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="contiguous CPU tensors"):
        monkeypatch.setattr(huge_pages, "THP_ENABLED", tmp_path / "enabled")
        (tmp_path / "enabled").write_text("[always] madvise never\n")
        huge_pages.huge_page_copies([torch.randn(4, 4).T])

