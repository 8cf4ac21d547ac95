"""The package's shape, read from its source with ``ast``: generic patches never import an
upstream integration, nothing imports in a cycle, and the installed package carries no
demo or test fixture."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "patches"
# Modules above the generic patches: they may import the integrations.
TOP = {"patches", "patches.auto", "patches.__main__", "patches.cli", "patches.tools.cli", "patches.tools.launcher"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    if node.level == 0:
        base = node.module or ""
    else:
        parts = module.split(".")
        anchor = parts if is_package else parts[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([node.module] if node.module else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (function-local imports included)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                targets = _resolve(name, is_package, node)
            else:
                continue
            for target in targets:
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def _is_integration(name: str) -> bool:
    return name == "patches.integrations" or name.startswith("patches.integrations.")


def _is_generic(name: str) -> bool:
    return not (_is_integration(name) or name in TOP or name.startswith("patches.tools"))


def test_no_generic_module_imports_an_integration() -> None:
    upward = sorted(f"{src} -> {dst}" for src, dsts in import_graph().items()
                    if _is_generic(src) for dst in dsts if _is_integration(dst))
    assert upward == []


def test_no_import_cycles() -> None:
    graph = import_graph()
    # a package's __init__ importing its own submodules is how packages are made: not a cycle
    edges = {src: {dst for dst in dsts if not src.startswith(dst + ".")}
             for src, dsts in graph.items()}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert cycles == []


def test_the_walker_sees_an_upward_edge(tmp_path: Path) -> None:
    """The test above can fail: a function-local upward import is found."""
    source = "def f():\n    from .integrations import coqui_trainer\n"
    node = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom))
    assert "patches.integrations.coqui_trainer" in _resolve("patches.nan_guard", False, node)


def test_the_installed_package_is_the_library_only() -> None:
    fixtures = sorted(name for name in _modules()
                      if any(word in name.rsplit(".", 1)[-1] for word in ("demo", "tiny")))
    assert fixtures == []
