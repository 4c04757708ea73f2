"""The import rules of docs/ARCHITECTURE.md, read from the source (every import counts, those
under ``TYPE_CHECKING`` too): the layer order (each layer imports only the layers below it and
the leaves), no import circle among vmkv's modules, vmkv/
never imports the server (except `vmkv serve`, lazily), the server imports itself as
vmkv.server, and vmkv.bench does not import the CLI that drives it."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: vmkv's layers, top first (docs/ARCHITECTURE.md): a module imports the layers below its own,
#: modules of its own layer, and the leaves; never a layer above
LAYERS: list[tuple[str, ...]] = [
    ("vmkv.cli",),
    ("vmkv.bench",),
    ("vmkv.server",),
    ("vmkv.llm", "vmkv.engine", "vmkv.spec_decode"),
    ("vmkv.executor", "vmkv.distributed"),
    ("vmkv.models",),
    ("vmkv.attention", "vmkv.sampling", "vmkv.structured"),
    ("vmkv.kv",),
    ("vmkv.memory", "vmkv.kernels"),
]
#: modules every layer may import; they import only each other (no torch-free module may pull
#: a layer in, and collectives stay a leaf under the model and the executor alike)
LEAVES = ("vmkv", "vmkv.config", "vmkv.options", "vmkv.config_args", "vmkv.envs",
          "vmkv.cpu_info", "vmkv.sampling_params", "vmkv.commands", "vmkv.parent_death",
          "vmkv.process_tuning", "vmkv.chat_template", "vmkv.structured.params",
          "vmkv.distributed.collectives", "vmkv.spec_decode.config")


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


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "server":
        parts = ["vmkv", *parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_graph() -> dict[str, set[str]]:
    """vmkv's modules (the server's as vmkv.server.*) -> the vmkv modules each one imports
    anywhere: module level, inside a function, and under ``TYPE_CHECKING`` (a type-only import
    still ties the two modules together: a circle through one is a circle)."""
    files = {_module_name(p): p for p in [*_package_files("vmkv"), *_package_files("server")]}
    return {module: _vmkv_imports(path, files) - {module} for module, path in files.items()}


def _vmkv_imports(path: Path, files: dict[str, Path]) -> set[str]:
    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(m for a in node.names if (m := resolve(a.name)))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            subs = {f"{node.module}.{a.name}" for a in node.names} & files.keys()
            found.update(subs)
            if len(subs) < len(node.names) and (m := resolve(node.module)):
                found.add(m)
    return found


def _layer(module: str) -> int | None:
    """The index of ``module``'s layer in LAYERS (0: top), None for a leaf."""
    if module in LEAVES:
        return None
    for i, layer in enumerate(LAYERS):
        if any(_is(module, name) for name in layer):
            return i
    raise AssertionError(f"{module} is in no layer of LAYERS and not a leaf: place it")


def test_every_module_imports_only_the_layers_below_it_and_the_leaves() -> None:
    upward = []
    for module, imported in _module_graph().items():
        mine = _layer(module)
        for target in imported:
            theirs = _layer(target)
            if module == "vmkv" and target == "vmkv.llm":
                continue  # the package's lazy `vmkv.LLM`
            if mine is None and theirs is not None or (
                    mine is not None and theirs is not None and theirs < mine):
                upward.append(f"{module} -> {target}")
    assert sorted(upward) == [], "imports against the layer order"


def test_the_engine_and_the_executor_reach_memory_only_through_the_kv_contract() -> None:
    above_kv = ("vmkv.engine", "vmkv.llm", "vmkv.executor", "vmkv.distributed")
    uses = [f"{module} -> {target}" for module, imported in _module_graph().items()
            if any(_is(module, name) for name in above_kv)
            for target in imported if _is(target, "vmkv.memory")]
    assert uses == []


def test_no_import_circle_among_modules() -> None:
    graph = _module_graph()
    graph["vmkv"] = set()  # the package only re-exports lazily (`vmkv.LLM`)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def strongly_connected(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                strongly_connected(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            strongly_connected(v)
    assert circles == []


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
