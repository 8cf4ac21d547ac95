"""The walk of a single-file load goes one way down, read from the source with ``ast``:
load -> decide -> file_model -> parts -> optimizer -> ema -> plan -> reading, and the report and RNG
helpers import none of them. No module below calls back up into one above it."""

from __future__ import annotations

import ast

from test_import_graph import _resolve, import_graph

PKG = "patches.checkpoint"
# Top to bottom: a module may import only the ones after it in this list.
DOWN = ["load", "decide", "file_model", "parts", "optimizer", "ema", "plan", "reading"]
# Leaves the phases use: they import none of the modules above.
LEAVES = ["report", "rng", "errors", "atomic", "data_position"]


def _upward_edges(graph: dict[str, set[str]]) -> list[str]:
    rank = {f"{PKG}.{name}": index for index, name in enumerate(DOWN)}
    leaves = {f"{PKG}.{name}": len(DOWN) for name in LEAVES}
    return sorted(f"{src} -> {dst}" for src, dsts in graph.items() if src in rank or src in leaves
                  for dst in dsts if dst in rank and rank[dst] <= {**rank, **leaves}[src])


def test_the_load_path_goes_one_way_down() -> None:
    graph = import_graph()
    assert all(f"{PKG}.{name}" in graph for name in DOWN + LEAVES)  # none renamed away
    assert _upward_edges(graph) == []


def test_an_upward_import_is_found() -> None:
    """The test above can fail: plan importing load (a call back up) is an upward edge."""
    node = ast.parse("def f():\n    from .load import POLICIES\n").body[0].body[0]
    assert isinstance(node, ast.ImportFrom)
    targets = set(_resolve(f"{PKG}.plan", False, node))
    graph = {f"{PKG}.plan": targets & {f"{PKG}.load"}}
    assert _upward_edges(graph) == [f"{PKG}.plan -> {PKG}.load"]
