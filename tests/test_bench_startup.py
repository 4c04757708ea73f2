"""`vmkv bench startup`: a fresh process from spawn to its first token."""

from __future__ import annotations

import json
from pathlib import Path

from vmkv.cli import main


def test_startup_in_a_fresh_process(default_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    assert main(["bench", "startup", "--repeats", "1", "--max-model-len", "64",
                 "--kv-cache-memory", "16M", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["median"]) == {"cold", "warm"}
    for m in result["median"].values():
        assert 0 < m["interpreter_s"] <= m["imports_s"] <= m["engine_s"] <= m["first_token_s"]
    assert [r["cache"] for r in result["rows"]] == ["cold", "warm", "cold", "warm"]
    assert result["engine_argv"] == ["--max-model-len", "64", "--kv-cache-memory", "16777216"]


def test_engine_argv_reproduces_non_default_engine_options() -> None:
    import argparse

    from vmkv.bench.common import engine_argv
    from vmkv.config_args import add_engine_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    argv = ["--kv-mode", "paged", "--kv-cache-memory", "64M", "--block-size", "32",
            "--no-enable-prefix-caching"]  # a --x / --no-x option away from its default
    args = p.parse_args(argv)
    out = engine_argv(args)
    assert "--no-enable-prefix-caching" in out
    assert p.parse_args(out) == args
    assert engine_argv(p.parse_args([])) == []
