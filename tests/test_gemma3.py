"""Gemma 3 (text), the second model family: greedy tokens equal transformers' (float32) in both
KV modes, on a tiny random checkpoint whose prompts outrun its sliding window (whole and
chunked prefills) and on the real Gemma 3 270M (the installed package) with a prompt of more
than 2,000 tokens through the engine, in chunks; the config read from both."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from model_helpers import (
    KV_CASES,
    KV_IDS,
    greedy_generate,
    hf_greedy,
    make_kv,
    prefill_logits,
    save_random_model,
)
from skip_policy import require_bf16_kernels, require_f32_brgemm, require_mkl

from vmkv import LLM, SamplingParams
from vmkv.kv.spec import LayerGroup
from vmkv.models import ModelConfig, load_model, load_model_config, load_tokenizer, resolve_model
from vmkv.models.fused_layers import fuse_layers, unfusable

WINDOW = 16
TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=WINDOW,
            max_position_embeddings=1024, query_pre_attn_scalar=24, bos_token_id=None,
            eos_token_id=None, pad_token_id=None)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list, list]:
    """(checkpoint folder, prompts, transformers' greedy tokens) of a random tiny Gemma 3:
    five sliding layers of window 16 to one full layer, prompts up to 70 tokens."""
    path = tmp_path_factory.mktemp("gemma3")
    hf_model = save_random_model(transformers.Gemma3TextConfig(**TINY), path, seed=1)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, TINY["vocab_size"], (n,), generator=gen).tolist()
               for n in (5, 40, 70, 1)]
    return path, prompts, hf_greedy(hf_model, prompts, max_new_tokens=30)


@pytest.mark.parametrize("chunk", [None, 7], ids=["whole", "chunked"])
@pytest.mark.parametrize(("kv_mode", "layout"), KV_CASES, ids=KV_IDS)
def test_tiny_gemma3_greedy_matches_transformers(tiny: tuple[Path, list, list], kv_mode: str,
                                                 layout: str, chunk: int | None) -> None:
    path, prompts, expected = tiny
    model, cfg = load_model(path, torch.float32, "cpu")
    kv = make_kv(cfg, kv_mode, layout, max_model_len=128)
    try:
        got = greedy_generate(model, kv, prompts, max_new_tokens=30, prefill_chunk=chunk)
    finally:
        kv.close()
    assert got == expected


def test_tiny_gemma3_config_and_model(tiny: tuple[Path, list, list]) -> None:
    """What the checkpoint says reaches the config, the KV spec and the model; the fused C++
    layers of the MKL library say why they do not take Gemma's."""
    path, _, _ = tiny
    cfg = load_model_config(path)
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.hidden_act == "gelu_pytorch_tanh"
    assert cfg.layer_windows == (WINDOW,) * 5 + (0,)
    assert cfg.max_model_len == 1024  # the model's own, not the window
    assert cfg.scale == 24**-0.5
    assert (cfg.rope.theta, cfg.local_rope.theta) == (1e6, 1e4)
    spec = cfg.kv_spec(torch.float32)
    assert spec.groups == (LayerGroup((5,)), LayerGroup((0, 1, 2, 3, 4), WINDOW))
    assert spec.windows == cfg.layer_windows
    model, _ = load_model(path, torch.float32, "cpu")
    assert model.embed_scale == pytest.approx(64**0.5)
    require_mkl()
    model, _ = load_model(path, torch.float32, "cpu", linear_backend="mkl")
    assert "brgemm library only" in unfusable(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("kv_mode", ["virtual", "paged"])
def test_tiny_gemma3_fused_layers_equal_the_modules(tiny: tuple[Path, list, list], kv_mode: str,
                                                   dtype: torch.dtype) -> None:
    """The brgemm library's Gemma 3 layers (sandwich and q/k norms, tanh-GELU, a RoPE table per
    layer type) give every position's logits as the torch modules do, prefilled in chunks
    across the window and decoded a token a step: float32 up to summation order; bfloat16 with
    the same roundings, but tanh-GELU's and the norms' last float bit differ from torch's
    (Sleef's tanh, its reduction order), which after rounding to bf16 flips a value now and
    then, carried along in the K/V of every later position: a random tiny model amplifies one
    flip to ~0.3 in its logits (scale ~15), while a wrong norm, RoPE table or activation moves
    them by whole units."""
    require_f32_brgemm() if dtype == torch.float32 else require_bf16_kernels()
    path, _, _ = tiny
    modules, cfg = load_model(path, dtype, "cpu", linear_backend="brgemm")
    fused, _ = load_model(path, dtype, "cpu", linear_backend="brgemm")
    assert unfusable(modules) is None and fuse_layers(fused) is not None
    prompt = torch.randint(0, cfg.vocab_size, (70,), generator=torch.Generator().manual_seed(3))
    for chunk in (40, 1):
        logits = []
        for model in (fused, modules):
            kv = make_kv(cfg, kv_mode, max_model_len=128, dtype=dtype)
            try:
                logits.append(prefill_logits(model, kv, prompt.tolist(), chunk=chunk))
            finally:
                kv.close()
        if dtype == torch.bfloat16:
            torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0.5)
            top1 = (logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean().item()
            assert top1 >= 0.9
        else:
            torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=5e-4)


def test_gemma3_features_vmkv_does_not_implement_are_refused() -> None:
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        hf = transformers.Gemma3TextConfig(**TINY, **{field: 30.0})
        with pytest.raises(ValueError, match=field):
            ModelConfig.from_hf(hf)
    hf = transformers.Gemma3TextConfig(**TINY, hidden_activation="relu")
    with pytest.raises(ValueError, match="tanh GELU"):
        ModelConfig.from_hf(hf)


# -- the real Gemma 3 270M -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma3() -> Path:
    """The converted Gemma 3 270M; fails with the ``pip install`` line where the package is
    missing (the Makefile installs it)."""
    return resolve_model("gemma-3-270m", progress=False)


def test_gemma3_270m_config(gemma3: Path) -> None:
    cfg = load_model_config(gemma3)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        18, 640, 4, 1, 256)
    assert cfg.layer_windows == ((512,) * 5 + (0,)) * 3
    assert cfg.max_model_len == 32768 and cfg.vocab_size == 262144
    assert cfg.tie_word_embeddings and cfg.scale == 256**-0.5
    assert cfg.kv_spec(torch.bfloat16).bytes_per_token == 18432  # the figure


#: (prompt tokens, new tokens): a prompt of more than 2,000 tokens (four windows) and a short one
LONG, SHORT = (2100, 16), (300, 32)


def _long_prompts(path: Path) -> list[list[int]]:
    tok = load_tokenizer(path)
    text = " ".join(f"Item {i}: the quick brown fox number {i * 7 % 13} jumps over the lazy "
                    "dog." for i in range(160))
    ids = tok(text)["input_ids"]
    return [ids[: LONG[0]], ids[: SHORT[0]]]


@pytest.mark.parametrize("kv_mode", ["virtual", "paged"])
def test_gemma3_270m_long_prompt_matches_transformers(gemma3: Path, kv_mode: str,
                                                     reference_270m: dict[str, Any]) -> None:
    """The engine (its fused or compiled layers, 512-token chunks, the sliding layers giving
    back what falls behind their window) gives transformers' greedy tokens on a 2,100-token
    prompt batched with a short one. (Preemption with windows: tests/test_kv_groups.py, on a
    tiny Gemma 3.)"""
    prompts, want = reference_270m["prompts"], reference_270m["tokens"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in (LONG[1], SHORT[1])]
    with LLM(model=str(gemma3), kv_mode=kv_mode, dtype="float32", kv_cache_memory=256 << 20,
             max_num_batched_tokens=512, block_size=16) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.engine.kv.accounting.check()
    assert got == want


@pytest.fixture(scope="module")
def reference_270m(gemma3: Path) -> dict[str, Any]:
    """transformers' greedy tokens (float32) for :func:`_long_prompts`."""
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(gemma3, dtype=torch.float32)
    prompts = _long_prompts(gemma3)
    tokens = [hf_greedy(hf_model.eval(), [p], n)[0]
              for p, n in zip(prompts, (LONG[1], SHORT[1]), strict=True)]
    return {"prompts": prompts, "tokens": tokens}


def test_serve_takes_the_model_as_a_flag_too() -> None:
    """``vmkv serve --model gemma-3-270m`` as vLLM spells it, or the positional model."""
    from vmkv.cli import build_parser
    from vmkv.config_args import engine_config

    parser = build_parser()
    for argv in (["serve", "--model", "gemma-3-270m"], ["serve", "gemma-3-270m"]):
        assert engine_config(parser.parse_args(argv)).model == "gemma-3-270m"
    with pytest.raises(ValueError, match="two models"):
        engine_config(parser.parse_args(["serve", "a", "--model", "b"]))


def test_the_base_model_serves_completions_and_chat_only_with_a_template(gemma3: Path) -> None:
    """Gemma 3 270M is a base model: its tokenizer has no chat template, so /v1/completions
    works, chat is a 400 naming --chat-template, and chat works once the server has one."""
    import openai
    from serving import client_of, serve

    from vmkv.config import EngineConfig

    template = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    ask = [{"role": "user", "content": "Name a colour."}]
    config = EngineConfig(model=str(gemma3), kv_cache_memory=256 << 20, enforce_eager=True)
    running = serve(config, chat_template=template)
    srv = next(running)
    try:
        client = client_of(srv)
        done = client.completions.create(model="smol", prompt="The sky is", max_tokens=4,
                                         temperature=0)
        assert done.usage.completion_tokens == 4 and done.choices[0].text
        chat = client.chat.completions.create(model="smol", messages=ask, max_tokens=4,
                                              temperature=0)
        assert chat.usage.completion_tokens == 4
        # the same engine without the server's template: a clear 400
        from test_server import start

        bare = start(srv.engine)
        try:
            with pytest.raises(openai.BadRequestError, match="--chat-template"):
                client_of(bare).chat.completions.create(model="smol", messages=ask,
                                                        max_tokens=4)
            assert client_of(bare).completions.create(model="smol", prompt="Hi",
                                                      max_tokens=2).usage.completion_tokens == 2
        finally:
            bare.stop()
    finally:
        next(running, None)
