"""The int8 LM head (``--lm-head-dtype int8``, csrc/cpu_int8_head.cpp): its products against
the same quantized arithmetic in torch, its rescored candidates against the dense head, and the
engine's greedy tokens against the dense head's in both KV modes."""

from __future__ import annotations

import pytest
import torch
from skip_policy import NEEDS_BF16, NEEDS_VNNI, require, require_default_model

from vmkv.cpu_info import bf16_hardware, cpu_features
from vmkv.kernels import cpu_int8_head
from vmkv.kernels.build import load_failure
from vmkv.llm import LLM
from vmkv.models import load_model, resolve_model
from vmkv.models.quant.int8_head import CANDIDATES, Int8Head
from vmkv.sampling_params import SamplingParams


@pytest.fixture(autouse=True, scope="module")
def _available() -> None:
    if not set(cpu_features().split()) & set(cpu_int8_head.INT8_FLAGS):
        pytest.skip(NEEDS_VNNI)
    require(lambda: cpu_int8_head.unavailable_reason() is None, "the int8 LM head",
            lambda: f"{cpu_int8_head.unavailable_reason()}\n"
                    f"{load_failure(cpu_int8_head.LIBRARY) or ''}")


def quantized_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The head's arithmetic in torch for an ``x`` whose rows quantize exactly (integers times
    a power of two, each row's largest magnitude 127 times it): W per row to int8, the integer
    products exact."""
    packed = cpu_int8_head.pack(weight)
    n, k = weight.shape
    codes = packed.packed.permute(0, 2, 1, 3).reshape(-1, k)[:n].to(torch.float64)  # [N, K]
    sx = x.to(torch.float64).abs().amax(dim=1, keepdim=True) / 127  # [m, 1]
    return (x.to(torch.float64) / sx) @ codes.t() * sx * packed.scale[:n].to(torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 64, 130])
def test_products_are_the_quantized_arithmetic(dtype: torch.dtype, rows: int) -> None:
    """Without rescoring, every logit is (u8(x) W8 - comp) s_x s_w: torch's exact integer
    products within float32 rounding of the scales, over 1,000 rows (not a multiple of the
    64-column blocks) and a strided x; and within the int8 rounding of the dense head's."""
    torch.manual_seed(rows)
    weight = torch.randn(1000, 640).to(dtype)
    head = Int8Head(weight)
    codes = torch.randint(-127, 128, (rows, 700))
    codes[:, 30] = 127
    x = (codes * 2.0**-5).to(dtype)[:, 30:670]  # [rows, 640], row stride 700
    out = torch.full((rows, 1000), float("nan"))
    cpu_int8_head.head(x, head._args, out, 0)
    assert torch.allclose(out.double(), quantized_logits(x, weight), atol=1e-4, rtol=1e-5)
    y = torch.randn(rows, 640).to(dtype)
    cpu_int8_head.head(y, head._args, out, 0)
    dense = y.double() @ weight.double().t()
    assert (out.double() - dense).abs().max() < 0.02 * dense.abs().max()


def test_candidates_are_rescored_from_the_dense_head() -> None:
    """Each row's 16 largest int8 logits are replaced by the dense head's (float32 sums of the
    bf16 products), so the greedy token is the dense head's on every row here."""
    torch.manual_seed(0)
    weight = torch.randn(5000, 640).to(torch.bfloat16)
    head = Int8Head(weight)
    x = torch.randn(64, 640).to(torch.bfloat16)
    approx = torch.empty(64, 5000)
    cpu_int8_head.head(x, head._args, approx, 0)
    got = head(x)
    dense = x.float() @ weight.float().t()  # [64, 5000]
    top = approx.topk(CANDIDATES, dim=1).indices
    assert torch.allclose(got.gather(1, top), dense.gather(1, top), atol=1e-4, rtol=1e-5)
    rest = torch.ones_like(got, dtype=torch.bool).scatter_(1, top, False)
    assert torch.equal(got[rest], approx[rest])
    assert torch.equal(got.argmax(dim=1), dense.argmax(dim=1))
    out = torch.empty(64, 5000)
    assert head(x, out=out) is out and torch.equal(out, got)


def test_rows_with_fewer_finite_logits_than_candidates() -> None:
    """A zero row of x (scale 0) gives zero products, rescored to the dense zeros; a head of
    fewer rows than CANDIDATES rescores every row."""
    weight = torch.randn(8, 64)
    head = Int8Head(weight)
    x = torch.zeros(2, 64)
    x[1] = torch.randn(64)
    got = head(x)
    assert torch.allclose(got, x @ weight.t(), atol=1e-5)


def test_bad_input_is_refused() -> None:
    head = Int8Head(torch.randn(100, 64))
    with pytest.raises(ValueError, match="divisible by 4"):
        Int8Head(torch.randn(10, 66))
    with pytest.raises(ValueError, match="takes x"):
        head(torch.randn(2, 32))
    with pytest.raises(ValueError, match="takes x"):
        head(torch.randn(2, 64), out=torch.empty(2, 99))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        Int8Head(torch.randn(10, 64).half())
    with pytest.raises(ValueError, match="do not match"):
        cpu_int8_head.head_args(cpu_int8_head.pack(torch.randn(10, 64)), torch.randn(11, 64))


def test_the_engine_refuses_what_it_cannot_run() -> None:
    """A GGUF file's own Q8_0 head is already quantized; CUDA has no int8 head; a bad name."""
    require_default_model()
    path = resolve_model(None)
    with pytest.raises(ValueError, match="already quantized"):
        load_model(path, "float32", quantization="gguf", lm_head_dtype="int8")
    with pytest.raises(ValueError, match="runs on the CPU"):
        load_model(path, "float32", device="meta", lm_head_dtype="int8")
    with pytest.raises(ValueError, match="lm_head_dtype"):
        LLM(lm_head_dtype="int4")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_tokens_are_the_dense_heads_in_both_kv_modes(dtype: str) -> None:
    """The default model (tied embeddings: the head rescores from the embedding table):
    greedy tokens and their logprobs' tokens with the int8 head equal the dense head's, in
    virtual and paged mode, and no KV is left behind."""
    if dtype == "bfloat16" and not bf16_hardware():
        pytest.skip(NEEDS_BF16)
    require_default_model()
    prompts = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time " * 40,
               "Virtual memory keeps each request's cache contiguous, so"]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = {}
    for mode in ("virtual", "paged"):
        for head in ("auto", "int8"):
            with LLM(kv_mode=mode, dtype=dtype, lm_head_dtype=head,
                     kv_cache_memory=64 << 20) as llm:
                assert isinstance(llm.engine.executor.model_parts().model.lm_head,
                                  Int8Head) == (head == "int8")
                res = llm.generate(prompts, params, use_tqdm=False)
                outs[mode, head] = [o.outputs[0].token_ids for o in res]
                assert llm.engine.kv.room.request_ids() == []
    assert outs["virtual", "int8"] == outs["virtual", "auto"]
    assert outs["paged", "int8"] == outs["paged", "auto"] == outs["virtual", "auto"]
