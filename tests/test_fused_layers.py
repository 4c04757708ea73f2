"""Fused CPU decoder layers (vmkv.models.fused_layers, csrc/cpu_decoder_layer.cpp): the same
numbers as the layers run as torch modules, refused shapes, the fallbacks and the profiling
counters. Greedy equality with transformers is in test_models.py and test_engine.py."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import pytest
import torch
from model_helpers import _step, make_kv, prefill_logits, save_tiny_llama
from skip_policy import require_cpu_kernel, require_f32_brgemm, require_mkl

from vmkv.attention import create_attention_backend
from vmkv.kernels import cpu_decoder_layer as kernels
from vmkv.models import load_model
from vmkv.models.fused_layers import FusedLayers, fuse_layers, unfusable


@pytest.fixture(autouse=True, scope="module")
def _fusable() -> None:
    """The fused path needs MKL's packed GEMM in torch and the kernel library built."""
    require_mkl()
    require_cpu_kernel(kernels)



@pytest.fixture(scope="module", params=["plain", "all-biases"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> Path:
    """A tiny random Llama without biases, or with every linear's bias."""
    path = tmp_path_factory.mktemp(request.param)
    save_tiny_llama(path, bias=request.param == "all-biases")
    return path


@pytest.mark.parametrize("backend", ["mkl", "brgemm"])
@pytest.mark.parametrize("kv_mode", ["virtual", "paged"])
def test_fused_logits_equal_the_modules(checkpoint: Path, kv_mode: str, backend: str) -> None:
    """Prefill steps of 300 tokens (the elementwise loops on the OpenMP team) and of 5 (on the
    calling thread), then single-token steps: every position's logits as the modules give,
    for both float32 layer libraries (MKL's packed GEMM; the brgemm body in float32)."""
    if backend == "brgemm":
        require_f32_brgemm()
    modules, cfg = load_model(checkpoint, linear_backend=backend)
    fused, _ = load_model(checkpoint, linear_backend=backend)
    assert fuse_layers(fused) is not None and unfusable(modules) is None
    prompt = torch.randint(0, cfg.vocab_size, (310,), generator=torch.Generator().manual_seed(1))
    for chunk in (300, 5, 1):
        logits = []
        for model in (fused, modules):
            kv = make_kv(cfg, kv_mode, max_model_len=512)
            try:
                logits.append(prefill_logits(model, kv, prompt.tolist(), chunk=chunk))
            finally:
                kv.close()
        # fp32 rounding only (the norm's summation order, exp's last bit), as between
        # chunkings (test_models.py)
        torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=5e-5)


def test_bad_shapes_are_refused(checkpoint: Path) -> None:
    """The C calls check the geometry against every weight and return 1 (nothing written)
    for a mismatch, a negative row count or an attention row stride below Hq * D."""
    model, cfg = load_model(checkpoint, linear_backend="mkl")
    fused = FusedLayers(model)
    lib, layer = fused.lib, fused.layers[0]
    x = torch.randn(3, cfg.hidden_size)
    cos, sin = model.rotary(torch.arange(3), torch.float32)
    h = torch.empty(3, cfg.hidden_size)
    qkv = torch.full((3, fused.qkv_width), 7.0)
    gu = torch.empty(3, 2 * cfg.intermediate_size)
    attn = torch.randn(3, cfg.q_size)

    def attn_in(shape: kernels.LayerShape, t: int) -> int:
        return lib.vmkv_layer_attn_in(ctypes.byref(shape), layer, x.data_ptr(), t,
                                      cos.data_ptr(), sin.data_ptr(), h.data_ptr(),
                                      qkv.data_ptr())

    assert attn_in(fused.shape, 3) == 0 and not (qkv == 7.0).all()
    qkv.fill_(7.0)
    for field, value in (("hidden", cfg.hidden_size + 1), ("num_kv_heads", 1),
                         ("intermediate", 1), ("head_dim", cfg.head_dim - 1)):
        wrong = kernels.LayerShape.from_buffer_copy(fused.shape)
        setattr(wrong, field, value)
        assert attn_in(wrong, 3) == 1, field
    assert attn_in(fused.shape, -1) == 1
    assert (qkv == 7.0).all()  # nothing was written
    before = x.clone()
    assert lib.vmkv_layer_attn_out(ctypes.byref(fused.shape), layer, x.data_ptr(), 3,
                                   attn.data_ptr(), cfg.q_size - 1, h.data_ptr(),
                                   gu.data_ptr()) == 1
    assert torch.equal(x, before)


def test_profile_counts_gemm_and_elementwise_time(checkpoint: Path) -> None:
    model, cfg = load_model(checkpoint, linear_backend="mkl")
    fused = fuse_layers(model)
    assert fused is not None
    kv = make_kv(cfg, "virtual")
    try:
        prefill_logits(model, kv, list(range(40)))
        assert fused.ns.tolist() == [0, 0]  # counters off by default
        fused.profile(True)
        prefill_logits(model, kv, list(range(40)))
        assert (fused.ns > 0).all()
        fused.profile(False)
        fused.ns.zero_()
        prefill_logits(model, kv, list(range(40)))
        assert fused.ns.tolist() == [0, 0]
    finally:
        kv.close()
    # 2 FLOPs per weight of the four linears, per token
    assert fused.flops_per_token == 2 * cfg.num_layers * cfg.hidden_size * (
        cfg.q_size + 2 * cfg.kv_size + cfg.q_size + 3 * cfg.intermediate_size)
    # a row the last layer drops skips its output projection and MLP
    assert fused.step_flops(10, 3) == fused.step_flops(10) - 7 * 2 * cfg.hidden_size * (
        cfg.q_size + 3 * cfg.intermediate_size)


@pytest.mark.parametrize("body", ["modules", "mkl", "brgemm"])
def test_kept_rows_are_the_full_steps_rows(checkpoint: Path, body: str) -> None:
    """A step asked for some rows only (``keep``: a prefill chunk's last rows, as the engine
    asks) gives those rows of the full step, and still writes every row's K/V: the next
    decode step after it equals the one after the full step."""
    if body == "brgemm":
        require_f32_brgemm()
    model, cfg = load_model(checkpoint, linear_backend="torch" if body == "modules" else body)
    if body != "modules":
        assert fuse_layers(model) is not None
    prompt = torch.randint(0, cfg.vocab_size, (90,), generator=torch.Generator().manual_seed(2))
    tokens = [prompt.tolist()]
    keep = [0, 41, 87, 88]
    outputs = []
    for rows in (None, keep):
        kv = make_kv(cfg, "paged", max_model_len=128)
        attn = create_attention_backend(kv)
        try:
            hidden = _step(model, kv, attn, ["req"], tokens, [0], [89], rows)
            decode = _step(model, kv, attn, ["req"], tokens, [89], [1])
            outputs.append((hidden, decode))
        finally:
            kv.close()
    (full, full_decode), (kept, kept_decode) = outputs
    assert kept.shape == (len(keep), cfg.hidden_size)
    torch.testing.assert_close(kept, full[keep], rtol=1e-5, atol=5e-5)
    assert torch.equal(kept_decode, full_decode)


def test_what_cannot_run_fused_says_why(checkpoint: Path, caplog: pytest.LogCaptureFixture,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    assert "not packed for mkl" in str(unfusable(load_model(checkpoint,
                                                            linear_backend="torch")[0]))
    assert "float16 on cpu" in str(unfusable(load_model(checkpoint, torch.float16)[0]))
    model, _ = load_model(checkpoint, linear_backend="mkl")
    monkeypatch.setenv("PATH", "/nonexistent")  # no g++ / c++: the library cannot build
    monkeypatch.setenv("VMKV_BUILD_DIR", str(Path(str(checkpoint)) / "empty-build-dir"))
    kernels._lib.cache_clear()
    try:
        with caplog.at_level(logging.INFO):
            assert fuse_layers(model) is None
    finally:
        kernels._lib.cache_clear()
    assert model.run_body is None  # the model's own body
    assert "fused CPU decoder layers off: the kernel library did not build" in caplog.text
