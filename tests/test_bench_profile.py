"""`vmkv bench profile`: a decode and a prefill step of the real engine, split into parts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from skip_policy import require_mkl

from vmkv.bench.profile import PARTS
from vmkv.cli import main


@pytest.mark.usefixtures("default_model")
@pytest.mark.parametrize(("kv_mode", "layers"), [("virtual", "modules"), ("paged", "fused"),
                                                ("virtual", "compiled"), ("virtual", "fused")])
def test_profile_parts_add_up_to_the_step(tmp_path: Path, kv_mode: str, layers: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Eager, compiled and fused layers alike: the linears and attention stay visible (fused
    layers time their own GEMMs)."""
    monkeypatch.setenv("VMKV_COMPILE", "1" if layers == "compiled" else "0")
    monkeypatch.setenv("VMKV_FUSED_LAYERS", "1" if layers == "fused" else "0")
    if layers == "fused":
        require_mkl()
    # the MKL library of fused layers (auto takes brgemm off Intel CPUs with AVX-512)
    backend = ["--linear-backend", "mkl"] if layers == "fused" else []
    out, png = tmp_path / "p.json", tmp_path / "p.png"
    assert main(["bench", "profile", "--kv-mode", kv_mode, "--batch-size", "3",
                 "--context-len", "40", "--prefill-batch", "2", "--prefill-len", "24",
                 "--repeats", "1", "--warmup", "1", *backend, "--json", str(out),
                 "--plot", str(png)]) == 0
    result = json.loads(out.read_text())
    assert result["compiled"] == (layers == "compiled")
    assert result["fused_layers"] == (layers == "fused")
    assert all(0 < rate < float("inf") for rate in result["rates"].values())
    decode, prefill = result["phases"]
    assert (decode["new_tokens"], decode["sampled"]) == (3, 3)
    assert (prefill["new_tokens"], prefill["sampled"]) == (48, 2)
    for phase in (decode, prefill):
        # one measured step per phase: its parts add up to its wall time (medians of several
        # steps' parts would not); the parts are nested timings, none negative
        assert sum(phase[p] for p in PARTS) == pytest.approx(phase["step_ms"], rel=1e-9)
        assert all(phase[p] >= 0 for p in PARTS if p != "engine_python")
        assert phase["gemm"] > 0 and phase["attention"] > 0 and phase["lm_head"] > 0
        # 30 layers x 4 linears x 2 FLOPs per multiply-add of the model's weights, but a prompt
        # row that samples nothing skips the last layer's output projection and MLP
        dropped = phase["new_tokens"] - phase["sampled"]
        assert phase["gemm_flops"] == 2 * phase["new_tokens"] * 30 * (
            576 * (576 + 2 * 192) + 576 * 576 + 576 * 2 * 1536 + 1536 * 576) - 2 * dropped * (
            576 * 576 + 576 * 2 * 1536 + 1536 * 576)
        assert 0 <= phase["cores_idle"] <= 1
        assert set(phase["roofline_ms"]) == set(PARTS)
    assert png.stat().st_size > 1000


@pytest.mark.usefixtures("default_model")
def test_a_decode_batch_the_kv_budget_cannot_hold_is_refused_up_front(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before any prefill, with the fix named (it used to fail after prefilling)."""
    assert main(["bench", "profile", "--dtype", "float32", "--kv-cache-memory", "64MiB",
                 "--batch-size", "64", "--context-len", "700"]) == 2
    err = capsys.readouterr().err
    assert "--batch-size 64 x --context-len 700 needs about 45248 KV tokens" in err
    assert "raise --kv-cache-memory" in err


def test_the_attention_and_kv_write_rooflines_read_the_kv_dtypes_bytes() -> None:
    """An int8 cache's rows (64 values + a 2-byte scale) set its memory floor, not the model's
    bf16 (the floor was bf16's before: the int8 kernel looked at its roofline at twice it)."""
    from types import SimpleNamespace

    import torch

    from vmkv.bench.profile import rooflines
    from vmkv.kv.spec import KVSpec

    cfg = SimpleNamespace(num_layers=30, kv_size=3 * 64, q_size=9 * 64, hidden_size=576,
                          intermediate_size=1536, vocab_size=49152)
    phase = {"new_tokens": 64, "sampled": 64, "kv_tokens_read": 32768, "attended_pairs": 32768,
             "gemm_flops": 0, "lm_head_flops": 0}
    rates = {"gemm_flops_per_s": 4e11, "bandwidth_bytes_per_s": 3e10, "read_bytes_per_s": 3e10}
    roofs = {}
    for dtype in (torch.bfloat16, torch.int8):
        engine = SimpleNamespace(model_config=cfg, executor=SimpleNamespace(dtype=torch.bfloat16),
                                 kv=SimpleNamespace(spec=KVSpec(30, 3, 64, dtype)))
        roofs[dtype] = rooflines(engine, phase, rates)
    bf16, int8 = roofs[torch.bfloat16], roofs[torch.int8]
    assert bf16["attention"] == pytest.approx(32768 * 2 * 30 * 3 * 64 * 2 / 3e10 * 1e3)
    assert int8["attention"] / bf16["attention"] == pytest.approx(66 / 128)
    assert int8["kv_write"] / bf16["kv_write"] == pytest.approx(66 / 128)
