"""The import rules of docs/ARCHITECTURE.md, read from the source: vmkv/ never imports the server
(except `vmkv serve`, lazily), the server imports itself as vmkv.server, and vmkv.bench does not
import the CLI that drives it."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> list[tuple[str, str | None]]:
    """(module imported, enclosing function or None) for every import in ``path``."""
    found: list[tuple[str, str | None]] = []

    def visit(node: ast.AST, function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend((alias.name, function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found.append((child.module, function))
            is_function = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            visit(child, child.name if is_function else function)

    visit(ast.parse(path.read_text()), None)
    return found


def _package_files(folder: str) -> list[Path]:
    """Python files of a top-level folder, not through the vmkv/server link."""
    return [p for p in (ROOT / folder).rglob("*.py")
            if not p.relative_to(ROOT).as_posix().startswith("vmkv/server/")]


def _is(module: str, name: str) -> bool:
    return module == name or module.startswith(name + ".")


def test_vmkv_imports_the_server_only_lazily_in_the_serve_command() -> None:
    uses = [(p.relative_to(ROOT).as_posix(), fn) for p in _package_files("vmkv")
            for module, fn in _imports(p) if _is(module, "vmkv.server") or _is(module, "server")]
    assert uses == [("vmkv/cli.py", "cmd_serve")]


def test_the_server_imports_itself_as_vmkv_server() -> None:
    top_level = [(p.name, module) for p in _package_files("server")
                 for module, _ in _imports(p) if _is(module, "server")]
    assert top_level == []
    spec = importlib.util.find_spec("vmkv.server")
    assert spec is not None and Path(spec.origin).resolve() == ROOT / "server" / "__init__.py"


def test_bench_does_not_import_the_cli() -> None:
    uses = [p.name for p in _package_files("vmkv/bench")
            for module, _ in _imports(p) if _is(module, "vmkv.cli")]
    assert uses == []
