"""Benchmarks and profilers attach through public hooks and stats (``LLMEngine.last_step``, the
KV manager's ``memory_stats()``, the executor's ``layers`` and ``model_parts()``), never by
patching what is private: read from the source of vmkv/bench and benchmarks/."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _owner(node: ast.expr) -> str:
    return node.id if isinstance(node, ast.Name) else ""


def _patches(path: Path) -> list[str]:
    """Where ``path`` writes a private attribute of another object, replaces an object's
    method with a function of its own, or names a private attribute to setattr/getattr or a
    wrapping helper."""
    tree = ast.parse(path.read_text())
    functions = {n.name for n in ast.walk(tree)
                 if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    found = []
    for node in ast.walk(tree):
        where = f"{path.name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if not isinstance(target, ast.Attribute) or _owner(target.value) in ("self",
                                                                                     "cls"):
                    continue
                value = node.value
                replaces = isinstance(value, ast.Lambda) or (
                    isinstance(value, ast.Name) and value.id in functions)
                if _private(target.attr) or replaces:
                    found.append(f"{where}: {ast.unparse(target)} = ...")
        elif isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            named = [a.value for a in node.args[1:2] if isinstance(a, ast.Constant)
                     and isinstance(a.value, str)]
            if (name in ("setattr", "getattr") or "wrap" in name or "patch" in name) and any(
                    _private(n) for n in named):
                found.append(f"{where}: {ast.unparse(node)}")
    return found


def test_bench_and_benchmarks_patch_nothing_private() -> None:
    files = [*(ROOT / "vmkv" / "bench").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]
    assert len(files) > 10
    assert [p for f in files for p in _patches(f)] == []


def test_the_check_sees_the_patches_it_forbids(tmp_path: Path) -> None:
    sample = tmp_path / "bench_sample.py"
    sample.write_text(
        "def recording():\n    pass\n\n\n"
        "def main(engine, timer):\n"
        "    engine.scheduler.schedule = recording\n"
        "    engine._sampler = None\n"
        "    timer._wrap(engine, '_sample', 'sampler')\n"
        "    setattr(engine, '_step', print)\n"
        "    engine.attn.batched_prefill = False\n"  # a public switch: allowed
        "    self_ok = engine.kv.accounting.memory_stats()\n")
    assert len(_patches(sample)) == 4


def test_benches_reach_no_worker_through_the_executor() -> None:
    """What benches read of how rank 0 runs (its layers, model, attention backend, graphs) is the
    executor's contract; its worker is private, and no bench reaches through to it."""
    from vmkv.executor.base import Executor
    from vmkv.executor.local import LocalExecutor

    files = [*(ROOT / "vmkv" / "bench").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]
    uses = [f"{f.relative_to(ROOT)}:{n}" for f in files
            for n, line in enumerate(f.read_text().splitlines(), 1)
            if re.search(r"executor\._?worker\b", line)]
    assert uses == []
    public = {name for name in dir(LocalExecutor) if not name.startswith("_")}
    assert "worker" not in public
    assert {"layers", "model_parts", "graph_replays"} <= set(dir(Executor))
