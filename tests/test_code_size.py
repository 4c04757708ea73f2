"""The house rules on size (docs/ARCHITECTURE.md, "Size"): no class in vmkv/ or server/ above
300 lines or 25 methods, no module above 450 lines, and a KV contract the engine sees of at most
15 public members. Read from the source, so a growing class fails here before it grows a
second job."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_CLASS_LINES = 300
MAX_CLASS_METHODS = 25
MAX_MODULE_LINES = 450
MAX_KV_CONTRACT_MEMBERS = 15


def _sources() -> list[Path]:
    return [p for folder in ("vmkv", "server") for p in (ROOT / folder).rglob("*.py")
            if not p.relative_to(ROOT).as_posix().startswith("vmkv/server/")]


def test_no_module_above_the_line_limit() -> None:
    big = {p.relative_to(ROOT).as_posix(): n for p in _sources()
           if (n := p.read_text().count("\n")) > MAX_MODULE_LINES}
    assert big == {}


def test_no_class_above_the_line_or_method_limit() -> None:
    big = {}
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            lines = node.end_lineno - node.lineno + 1
            methods = sum(isinstance(c, ast.FunctionDef | ast.AsyncFunctionDef)
                          for c in node.body)
            if lines > MAX_CLASS_LINES or methods > MAX_CLASS_METHODS:
                big[f"{path.relative_to(ROOT).as_posix()}:{node.name}"] = (lines, methods)
    assert big == {}


def test_the_kv_contract_is_small() -> None:
    from vmkv.kv import KVCacheManager

    # methods and properties, and the attributes declared by annotation only (kv_mode, spec...)
    declared = {name for klass in KVCacheManager.__mro__
                for name in getattr(klass, "__annotations__", {})}
    members = sorted(name for name in {*dir(KVCacheManager), *declared}
                     if not name.startswith("_") and name not in dir(object))
    assert len(members) <= MAX_KV_CONTRACT_MEMBERS, members
