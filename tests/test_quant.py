"""GGUF block formats served as the file holds them (vmkv.models.quant, csrc/cpu_quant_*): the
packing is the file's bytes rearranged; the kernels compute what the formats say, bit-identically
in every build (AVX-512 VNNI, AVX2, portable); the default model loads in its own formats at
its file's size; the one-user decode loop gives the per-layer path's numbers; both KV modes give
the same tokens; bad input is refused."""

from __future__ import annotations

import contextlib
from unittest import mock

import gguf
import numpy as np
import pytest
import torch
from kernel_builds import BUILDS, use_build
from model_helpers import make_kv, prefill_logits, save_tiny_llama
from skip_policy import (
    NEEDS_BF16,
    require,
    require_cpu_kernel,
    require_default_model,
)

from vmkv.cpu_info import cpu_features
from vmkv.kernels import cpu_quant
from vmkv.llm import LLM
from vmkv.models import load_model, resolve_model
from vmkv.models.fused_layers import fuse_layers
from vmkv.models.gguf_cache import gguf_source
from vmkv.models.quant.gguf_weights import GGUFWeights, weight_bytes
from vmkv.models.quant.int8 import u8_blocks, u8_dequantize
from vmkv.models.quant.modules import QuantLinear, QuantTensor
from vmkv.models.quant.packing import FORMATS, U8, pack, unpack
from vmkv.sampling_params import SamplingParams


@pytest.fixture(autouse=True, scope="module")
def _built() -> None:
    require_cpu_kernel(cpu_quant)


def quantized(ggml_type: int, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """A random ``[rows, k]`` weight quantized by the gguf package (the reference codec; U8,
    vmkv's own block, by vmkv's int8 encoder), off-centre so that U8's minimum matters."""
    w = np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32) * 0.05 + 0.01
    if ggml_type == U8:
        return u8_blocks(torch.from_numpy(w))
    return gguf.quantize(w, gguf.GGMLQuantizationType(ggml_type))


def dequantized(raw: np.ndarray, ggml_type: int, k: int) -> np.ndarray:
    """The float32 weight ``[rows, k]`` blocks hold (the gguf package's decoder; U8: d u + m)."""
    if ggml_type == U8:
        return u8_dequantize(raw, k).numpy()
    return gguf.dequantize(raw, gguf.GGMLQuantizationType(ggml_type)).reshape(-1, k)


def reference(x: torch.Tensor, raw: np.ndarray, ggml_type: int) -> np.ndarray:
    """What the kernels compute, in float64: the activations quantised per block of 32 to
    round(x / d), d = max|x| / 16256, times the dequantized weight."""
    m, k = x.shape
    xb = x.float().numpy().reshape(m, k // 32, 32)
    d = (np.abs(xb).max(-1) / np.float32(16256)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    codes = np.rint(xb * inv[..., None])
    w = dequantized(raw, ggml_type, k).reshape(-1, k // 32, 32)
    return np.einsum("mbe,nbe,mb->mn", codes, w.astype(np.float64), d.astype(np.float64))


@pytest.mark.parametrize("ggml_type", list(FORMATS))
def test_packing_is_the_files_bytes_rearranged(ggml_type: int) -> None:
    """pack -> unpack gives the GGUF bytes back (rows padded to 16 and dropped again), and a
    packed tensor is exactly the file's size once padded."""
    fmt = FORMATS[ggml_type]
    raw = np.random.default_rng(1).integers(0, 256, (40, 3 * fmt.block_bytes), dtype=np.uint8)
    packed = pack(raw, ggml_type, 96)
    assert packed.numel() == 48 * 3 * fmt.block_bytes  # 40 rows -> 3 groups of 16
    assert np.array_equal(unpack(packed, ggml_type, 40, 96), raw)


@pytest.fixture(params=list(BUILDS))
def build(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The kernel library built for one code path (the others need x86 switches)."""
    use_build(cpu_quant, request.param, monkeypatch)
    return request.param


@pytest.fixture
def integer_products(build: str) -> object:
    """The native library and ``build``'s with their dequantized bf16 tiles off (every row
    count on the integer products, or the AVX2 builds' int16 tiles: the same bits), restored
    after the test."""
    native = cpu_quant.build(cpu_quant.FLAGS)
    libs = (native, cpu_quant._lib())
    for lib in libs:
        cpu_quant.use_ukernel(lib, 0)
    yield native
    for lib in libs:
        cpu_quant.use_ukernel(lib)


@pytest.mark.parametrize("ggml_type", list(FORMATS))
def test_every_build_computes_the_formats_bit_for_bit(build: str, ggml_type: int,
                                                      integer_products: object) -> None:
    """Every format, 1-70 rows (one pass, several passes, integer row tiles), float32 and bf16
    activations: within float32 rounding of the float64 reference, and the same bits in every
    build as in the native one."""
    for rows, k, m in ((40, 96, 1), (64, 576, 5), (200, 1536, 70)):
        raw = quantized(ggml_type, rows, k)
        lin = QuantLinear([QuantTensor.from_gguf(raw, ggml_type, k)])
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(rows))
        got = lin(x)
        want = reference(x, raw, ggml_type)
        assert np.abs(got.numpy() - want).max() <= 1e-5 * np.abs(want).max()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cpu_quant, "_lib", lambda: cpu_quant.build(cpu_quant.FLAGS))
            assert torch.equal(got, lin(x))
            xb = x.to(torch.bfloat16)
            native_bf16 = lin(xb)
        assert native_bf16.dtype == torch.bfloat16 and torch.equal(lin(xb), native_bf16)


def require_tiles() -> None:
    """Skip off AVX512-BF16 (the tiles are its code); fail where they should run but do not."""
    if "avx512_bf16" not in cpu_features().split():
        pytest.skip(f"{NEEDS_BF16}: the dequantized tiles are AVX512-BF16 code")
    require(lambda: cpu_quant.use_ukernel(cpu_quant.library()), "the dequantized tiles",
            lambda: "this torch does not export oneDNN's brgemm ukernel")


@pytest.mark.parametrize("ggml_type", list(FORMATS))
def test_many_rows_multiply_dequantized_tiles(ggml_type: int) -> None:
    """From TILE_ROWS bf16 rows on (AVX512-BF16 builds where the brgemm ukernel runs), a product
    is the dequantized weight cast to bf16 times them, to bf16 rounding of that product in
    float64; a partial last tile (200 and 40 rows), several ukernel calls (300 rows) and a bias
    included. float32 activations keep the integer products (their two-byte codes: 1e-4)."""
    require_tiles()
    for rows, k, m in ((200, 1536, cpu_quant.TILE_ROWS), (40, 96, 300)):
        raw = quantized(ggml_type, rows, k)
        w = torch.from_numpy(dequantized(raw, ggml_type, k))
        bias = torch.randn(rows)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(rows))
        for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 8e-3)):
            lin = QuantLinear([QuantTensor.from_gguf(raw, ggml_type, k)], bias.to(dtype))
            xd = x.to(dtype)
            want = xd.double() @ w.to(dtype).double().T + bias.to(dtype).double()
            got = lin(xd)
            assert got.dtype == dtype
            assert (got.double() - want).abs().max() <= tol * want.abs().max(), (dtype, m)


@pytest.mark.parametrize("ggml_type", list(FORMATS))
def test_many_rows_take_int16_tiles_bit_for_bit(ggml_type: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """AVX2 builds (the no-avx512 build, on every x86 CPU here): from I16_TILE_ROWS rows on, a
    product widens each group once into int16 tiles (csrc/cpu_quant_i16_tiles.h), and gives the
    portable build's integer products bit for bit, float32 and bf16 activations alike: passes of
    1-6 rows, several row tiles with a short last one, a partial group and a bias included.
    Native AVX-512 builds have no int16 tiles."""
    native = cpu_quant.build(cpu_quant.FLAGS)
    assert cpu_quant.use_i16_tiles(native) == (cpu_quant.code_path() == "avx2")
    use_build(cpu_quant, "no-avx512", monkeypatch)
    with pytest.MonkeyPatch.context() as mp:  # the switch: 0 turns them off, nonsense refused
        mp.setenv("VMKV_QUANT_I16_TILE_ROWS", "0")
        assert not cpu_quant.use_i16_tiles(cpu_quant.library())
        mp.setenv("VMKV_QUANT_I16_TILE_ROWS", "eight")
        with pytest.raises(ValueError, match="whole number"):
            cpu_quant.use_i16_tiles(cpu_quant.library())
    assert cpu_quant.use_i16_tiles(cpu_quant.library())
    for rows, k, m in ((200, 1536, cpu_quant.I16_TILE_ROWS), (40, 96, 13), (40, 96, 125),
                       (40, 96, 2041), (40, 96, cpu_quant.I16_TILE_ROWS - 1)):
        raw, bias = quantized(ggml_type, rows, k), torch.randn(rows)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(rows))
        lins = {dtype: QuantLinear([QuantTensor.from_gguf(raw, ggml_type, k)], bias.to(dtype))
                for dtype in (torch.float32, torch.bfloat16)}
        got = {dtype: lin(x.to(dtype)) for dtype, lin in lins.items()}
        with pytest.MonkeyPatch.context() as mp:
            use_build(cpu_quant, "portable", mp)
            for dtype, lin in lins.items():
                assert torch.equal(lin(x.to(dtype)), got[dtype]), (m, dtype)


def test_segments_of_different_formats_make_one_linear() -> None:
    """q|k|v of different formats (Gemma 3's file: Q5_0 q and k, Q8_0 v) are one product, on
    the integer products and on dequantized tiles (which straddle the segments: 48 + 48 + 40)."""
    parts = [(6, 48), (6, 48), (8, 40)]
    raws = [quantized(t, n, 128, seed=i) for i, (t, n) in enumerate(parts)]
    tensors = [QuantTensor.from_gguf(r, t, 128) for r, (t, _) in zip(raws, parts, strict=True)]
    fused = QuantLinear(tensors)
    for m, dtype in ((3, torch.float32), (cpu_quant.TILE_ROWS, torch.bfloat16)):
        x = torch.randn(m, 128).to(dtype)
        alone = [QuantLinear([t])(x) for t in tensors]
        assert torch.equal(fused(x), torch.cat(alone, dim=1))


def test_bad_input_is_refused() -> None:
    lin = QuantLinear([QuantTensor.from_gguf(quantized(8, 16, 64), 8, 64)])
    with pytest.raises(ValueError, match=r"\[M, 64\]"):
        lin(torch.randn(2, 32))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        lin(torch.randn(2, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="multiple of 16 rows"):
        QuantLinear([QuantTensor.from_gguf(quantized(8, 8, 64), 8, 64)] * 2)
    with pytest.raises(ValueError, match="bytes per row"):
        pack(np.zeros((16, 10), dtype=np.uint8), 8, 64)


@pytest.fixture(scope="module")
def default_model() -> tuple:
    require_default_model()
    path = resolve_model(None)
    source = gguf_source(path)
    assert source is not None, "the default model's conversion does not name its GGUF file"
    return path, source


def test_the_default_model_is_its_files_weights_at_its_files_size(default_model: tuple) -> None:
    """Every linear's weight, unpacked and dequantized by the gguf package, is the dequantized
    (converted) model's weight exactly (q and k rows un-permuted as transformers does); the
    embedding rows too; resident weights within 1.15x the file's tensor bytes (measured:
    1.00x)."""
    path, source = default_model
    model, cfg = load_model(path, torch.float32, quantization="gguf")
    dense, _ = load_model(path, torch.float32, quantization="none", linear_backend="torch")
    assert weight_bytes(model) <= 1.15 * GGUFWeights(source).tensor_bytes
    for i in (0, cfg.num_layers - 1):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                     "mlp.down_proj"):
            lin = model.get_submodule(f"layers.{i}.{name}")
            rows = [gguf.dequantize(unpack(s.packed, s.ggml_type, s.rows, s.in_features),
                                    gguf.GGMLQuantizationType(s.ggml_type))
                    for s in lin.segments]
            weight = dense.get_submodule(f"layers.{i}.{name}").weight
            assert torch.equal(torch.from_numpy(np.concatenate(rows)), weight), name
    ids = torch.arange(0, cfg.vocab_size, 211)
    assert torch.equal(model.embed_tokens(ids), dense.embed_tokens(ids))


def test_teacher_forced_agreement_with_the_dequantized_model(default_model: tuple) -> None:
    """2,000+ positions of the project's docs through the default model in its own formats
    and in int8 (U8 blocks), float32 activations, and dequantized to float32: the same top-1
    token at >= 99 % of the positions and perplexity within 0.5 % for both (measured: gguf
    99.85-99.95 %, +0.002 %; one int8 byte per activation gave 94.7 %; int8 99.61 % on the
    accuracy bench's text, where the symmetric Q8_0 grid it replaced gave 97.5 %)."""
    from pathlib import Path

    from vmkv.models import load_tokenizer

    path, _ = default_model
    ids = load_tokenizer(path)((Path(__file__).parents[1] / "docs" / "ARCHITECTURE.md")
                               .read_text())["input_ids"][:2048]
    assert len(ids) == 2048
    logits = {}
    for quant in ("gguf", "int8", "none"):
        model, cfg = load_model(path, torch.float32, quantization=quant)
        # the file's formats fuse on every CPU; the dequantized model as the engine would (its
        # linears fuse where packed for mkl or brgemm: not on an AVX2 EPYC, where auto is onednn)
        assert fuse_layers(model) is not None or quant == "none"
        rows = []
        for start in range(0, 2048, 512):
            kv = make_kv(cfg, "virtual", max_model_len=512)
            try:
                rows.append(prefill_logits(model, kv, ids[start : start + 512]))
            finally:
                kv.close()
        logits[quant] = torch.cat(rows)
    targets = torch.tensor(ids[1:])
    nll = {q: torch.nn.functional.cross_entropy(lg[:-1], targets).item()
           for q, lg in logits.items()}
    for quant in ("gguf", "int8"):
        agree = (logits[quant].argmax(-1) == logits["none"].argmax(-1)).float().mean().item()
        assert agree >= 0.99, (quant, agree)
        assert abs(np.exp(nll[quant] - nll["none"]) - 1) <= 0.005, (quant, nll)


@pytest.mark.parametrize(("dtype", "kv_cache_dtype"),
                         [("float32", "auto"), ("bfloat16", "auto"), ("float32", "int8")])
def test_both_kv_modes_and_the_decode_loop_give_the_same_tokens(default_model: tuple,
                                                                dtype: str,
                                                                kv_cache_dtype: str) -> None:
    """Greedy through the engine on the file's formats: identical tokens in virtual and paged
    mode, and the one-user decode loop (every layer in one C call) gives the per-layer path's
    logprobs exactly, over the model's own cache and over an int8 one."""
    prompts = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time " * 40]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    outs = {}
    for mode, loop in (("virtual", True), ("paged", True), ("paged", False)):
        with LLM(kv_mode=mode, dtype=dtype, quantization="gguf", max_num_batched_tokens=128,
                 kv_cache_memory=64 << 20, kv_cache_dtype=kv_cache_dtype) as llm:
            fused = llm.engine.executor.model_parts().fused
            assert fused is not None and fused.decode_loop is not None
            counted = (mock.patch.object(fused.decode_loop, "run", wraps=fused.decode_loop.run)
                       if loop else contextlib.nullcontext())
            if not loop:
                fused.decode_loop = None
            with counted as run:
                res = llm.generate(prompts, params, use_tqdm=False)
            outs[mode, loop] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in res]
            assert llm.engine.kv.room.request_ids() == []
            assert not loop or run.call_count > 0, "no step went through the decode loop"
    assert outs["virtual", True] == outs["paged", True] == outs["paged", False]


def test_quantization_choices(tmp_path) -> None:  # noqa: ANN001
    """auto on an HF folder keeps its weights; gguf there is a clear error; auto on the default
    model serves its own formats."""
    save_tiny_llama(tmp_path, bias=False)
    model, _ = load_model(tmp_path, quantization="auto")
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    with pytest.raises(ValueError, match="--quantization gguf: .*not converted from a GGUF"):
        load_model(tmp_path, quantization="gguf")
    with pytest.raises(ValueError, match="quantization must be"):
        load_model(tmp_path, quantization="fp4")


def test_int8_weights(tmp_path) -> None:  # noqa: ANN001
    """--quantization int8 | w8a8 on an HF folder: every decoder linear quantized. int8: U8
    blocks of 32 (``w = d u + m``, u in [0, 255], in the quantized kernels' layout), each value
    within half a step of the weight, and half the symmetric grid's error on an off-centre block
    (Q8_0's ``s = max|w| / 127`` wastes the levels below the block's minimum); w8a8: codes
    ``round(w / s)`` per output channel through torch's _int_mm with per-token activations;
    both within int8's resolution of the float32 linear. A weight fp16 cannot scale is refused."""
    from vmkv.models.quant.int8 import W8A8Linear, channel_int8, int8_tensor

    w = torch.randn(48, 64) * 0.05
    codes, scale = channel_int8(w)
    assert codes.abs().max() <= 127 and scale.dtype == torch.float16
    t = int8_tensor(w)
    assert t.ggml_type == U8 and t.nbytes == 48 * 2 * 36
    # fp16 would round these blocks' minimum up (1.0) and their step down (a subnormal)
    edges = torch.stack([torch.linspace(0.9999, 1.01, 32), torch.linspace(0.1, 0.1009, 32)])
    for weight, raw in ((w, unpack(t.packed, U8, t.rows, t.in_features)),
                        (edges, u8_blocks(edges))):
        rows, blocks = weight.shape[0], weight.shape[1] // 32
        step = torch.from_numpy(raw.reshape(rows, blocks, 36)[..., 0:2].copy().view(np.float16))
        error = (u8_dequantize(raw, weight.shape[1]) - weight).abs().reshape(rows, blocks, 32)
        assert (error <= 0.5 * step.float() * (1 + 1e-3)).all()  # within half a step
    off_centre = torch.rand(16, 32, generator=torch.Generator().manual_seed(0)) * 0.1 + 0.02
    sym_codes, sym_scale = channel_int8(off_centre)  # Q8_0 of each row: one block of 32
    sym_error = (sym_codes.float() * sym_scale.float()[:, None] - off_centre).abs().max()
    u8_error = (u8_dequantize(u8_blocks(off_centre), 32) - off_centre).abs().max()
    assert u8_error < 0.6 * sym_error
    for bad in (torch.full((16, 32), float("inf")), torch.full((16, 32), 1e6)):
        with pytest.raises(ValueError, match="fp16 scales"):
            int8_tensor(bad)
    x = torch.randn(5, 64)
    exact = x @ w.t()
    dense = torch.nn.Linear(64, 48, bias=False)
    dense.weight.data = w
    for lin in (QuantLinear([t]), W8A8Linear(dense)):
        assert (lin(x) - exact).abs().max() <= 0.02 * exact.abs().max()
    save_tiny_llama(tmp_path, bias=True)
    for mode, kind in (("int8", QuantLinear), ("w8a8", W8A8Linear)):
        model, cfg = load_model(tmp_path, quantization=mode)
        assert all(isinstance(lin, kind) for layer in model.layers
                   for lin in (layer.self_attn.qkv_proj, layer.mlp.down_proj))
        assert not isinstance(model.lm_head, kind)


def test_w8a8_smoothing_keeps_the_model_and_tames_outlier_channels(tmp_path) -> None:  # noqa: ANN001
    """SmoothQuant's folds (norms, v's rows, up's rows; bias and grouped KV heads included)
    leave the dense model's output unchanged, and with an outlier input channel (as real
    models have) the smoothed w8a8 model errs less than the plain one. A folder without a
    tokenizer calibrates on fixed random tokens."""
    import copy

    from vmkv.attention.op import attention_step
    from vmkv.models.quant.int8 import quantize_linears
    from vmkv.models.quant.smooth import _WholeSequenceAttention, calibration_ids, smooth_for_w8a8

    save_tiny_llama(tmp_path, bias=True)
    model, _ = load_model(tmp_path, linear_backend="torch")
    for layer in model.layers:  # channel 5 of both norms' outputs 30x the rest
        layer.input_layernorm.weight[5] *= 30
        layer.post_attention_layernorm.weight[5] *= 30
    ids = calibration_ids(tmp_path, 320)
    assert len(ids) == 1200 and ids == calibration_ids(tmp_path, 320)

    def run(m: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad(), attention_step(_WholeSequenceAttention(), None):
            return m.body(torch.tensor(ids[:96]), torch.arange(96))  # [96, hidden]

    plain, smoothed = model, copy.deepcopy(model)
    want = run(plain)
    assert smooth_for_w8a8(smoothed, tmp_path)
    assert not torch.equal(smoothed.layers[0].self_attn.o_proj.weight,
                           plain.layers[0].self_attn.o_proj.weight)
    torch.testing.assert_close(run(smoothed), want, rtol=1e-4, atol=1e-4)
    quantize_linears(plain, "w8a8")
    quantize_linears(smoothed, "w8a8")
    assert (run(smoothed) - want).norm() < 0.7 * (run(plain) - want).norm()
