"""The test tiers' markers, read from the test files with ``ast``: a test that needs coqui
(imports TTS or trainer, or uses a helper or fixture that does) is marked ``xtts``, so that
``make test-fast`` (``-m "not slow and not xtts and not distributed"``) never needs it.

This is the static half of the rule; ``--check-markers`` (tests/conftest.py, used by
``make test-fast``) checks the same while the tests run, and checks ``slow`` too.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
COQUI = ("TTS", "trainer")
# Helpers outside the test files that need coqui: the tiny XTTS builder of demo/xtts_tiny.py
# (its methods import TTS inside) and conftest's fixtures and helpers, read below.
COQUI_HELPERS = {"build_tiny_xtts", "TinyXtts"}


def _imports_coqui(node: ast.AST) -> bool:
    """``import TTS...``, ``from trainer... import``, or ``pytest.importorskip("TTS")``."""
    if isinstance(node, ast.Import):
        return any(alias.name.partition(".")[0] in COQUI for alias in node.names)
    if isinstance(node, ast.ImportFrom):
        return node.level == 0 and (node.module or "").partition(".")[0] in COQUI
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and node.func.attr == "importorskip" and node.args \
            and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
        return node.args[0].value.partition(".")[0] in COQUI
    return False


def _top_level(tree: ast.Module) -> list[ast.AST]:
    """Every node that runs when the module is imported (not inside a def or class body)."""
    out, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.extend(node.decorator_list)
            continue
        out.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return out


def _functions(tree: ast.Module) -> dict[str, tuple[ast.FunctionDef, list[ast.ClassDef]]]:
    """Module functions and methods by name, each with its enclosing classes."""
    out: dict[str, tuple[ast.FunctionDef, list[ast.ClassDef]]] = {}

    def walk(body: list[ast.stmt], classes: list[ast.ClassDef]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[node.name] = (node, classes)
            elif isinstance(node, ast.ClassDef):
                walk(node.body, classes + [node])

    walk(tree.body, [])
    return out


def _needing_coqui(tree: ast.Module, known: set[str]) -> set[str]:
    """Names of the module's functions that need coqui: they import it, or they name (call,
    or take as a fixture argument) a function that does, here or in ``known``."""
    functions = _functions(tree)
    needs = {name for name, (fn, _) in functions.items()
             if any(_imports_coqui(node) for node in ast.walk(fn))}
    changed = True
    while changed:
        changed = False
        for name, (fn, _) in functions.items():
            if name in needs:
                continue
            used = {node.id for node in ast.walk(fn) if isinstance(node, ast.Name)}
            used |= {node.attr for node in ast.walk(fn) if isinstance(node, ast.Attribute)}
            used |= {arg.arg for arg in fn.args.args + fn.args.kwonlyargs}
            if used & (needs | known):
                needs.add(name)
                changed = True
    return needs


def _marks(nodes: list[ast.expr], aliases: dict[str, set[str]]) -> set[str]:
    """The marker names in decorators or a ``pytestmark`` value: ``pytest.mark.NAME``, a
    list of those, or a module-level alias ``NAME = pytest.mark.NAME``."""
    found: set[str] = set()
    for node in nodes:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Attribute) \
                    and sub.value.attr == "mark":
                found.add(sub.attr)
            elif isinstance(sub, ast.Name) and sub.id in aliases:
                found |= aliases[sub.id]
    return found


def _module_marks(tree: ast.Module) -> tuple[set[str], dict[str, set[str]]]:
    aliases: dict[str, set[str]] = {}
    marks: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name == "pytestmark":
                marks = _marks([node.value], aliases)
            else:
                value = _marks([node.value], {})
                if value and isinstance(node.value, ast.Attribute):
                    aliases[name] = value
    return marks, aliases


def _conftest_helpers() -> set[str]:
    tree = ast.parse((TESTS / "conftest.py").read_text(encoding="utf-8"))
    return _needing_coqui(tree, COQUI_HELPERS) | COQUI_HELPERS


def unmarked_coqui_tests(path: Path, known: set[str]) -> list[str]:
    """``file::test`` for each test in ``path`` that needs coqui and is not marked xtts."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    module_marks, aliases = _module_marks(tree)
    if "xtts" in module_marks:
        return []
    name = path.relative_to(TESTS.parent).as_posix() if path.is_relative_to(TESTS.parent) \
        else path.name
    if any(_imports_coqui(node) for node in _top_level(tree)):
        return [f"{name} (imports coqui when imported; mark the file: pytestmark)"]
    needs = _needing_coqui(tree, known)
    return [f"{name}::{test}" for test, (fn, classes) in _functions(tree).items()
            if test.startswith("test_") and test in needs
            and "xtts" not in _marks([d for c in classes for d in c.decorator_list]
                                     + fn.decorator_list, aliases)]


def test_every_test_that_needs_coqui_is_marked_xtts() -> None:
    known = _conftest_helpers()
    files = sorted(TESTS.rglob("test_*.py"))
    assert len(files) > 30  # the glob found the suite
    unmarked = [hit for path in files for hit in unmarked_coqui_tests(path, known)]
    assert not unmarked, ("these tests need coqui (TTS or trainer) but are not marked xtts, "
                          "so `make test-fast` would run them: add @pytest.mark.xtts\n  "
                          + "\n  ".join(unmarked))


def test_the_rule_sees_imports_fixtures_and_helpers(tmp_path: Path) -> None:
    """The analysis itself: each way of needing coqui is seen, each way of marking counts."""
    cases = {
        "import TTS\n\ndef test_a():\n    pass\n": 1,
        "import pytest\npytestmark = [pytest.mark.xtts]\nimport TTS\n\ndef test_a():\n    pass\n": 0,
        "def test_a():\n    from trainer import Trainer\n": 1,
        "import pytest\n\n@pytest.mark.xtts\ndef test_a():\n    import TTS\n": 0,
        "def test_a(tiny_xtts):\n    pass\n": 1,
        "def _fx():\n    import pytest\n    pytest.importorskip('trainer')\n\n"
        "def test_a(_fx):\n    pass\n\ndef test_b():\n    pass\n": 1,
        "import pytest\nxtts = pytest.mark.xtts\n\n@xtts\ndef test_a(tiny_xtts):\n    pass\n": 0,
        "def test_a():\n    import torch\n": 0,
    }
    known = _conftest_helpers()
    assert "tiny_xtts" in known and "write_amharic_base" in known
    for i, (source, expected) in enumerate(cases.items()):
        path = tmp_path / f"test_probe_{i}.py"
        path.write_text(source, encoding="utf-8")
        assert len(unmarked_coqui_tests(path, known)) == expected, source


class _TimedItem:
    """What ``--check-markers`` reads of a passed test item, without running one."""

    def __init__(self, wall: float, cpu: float, marks: tuple[str, ...] = ()) -> None:
        import pytest

        from conftest import _ITEM_TIME_KEY

        self.nodeid, self.fixturenames, self._marks = "tests/test_x.py::test_x", (), marks
        self.stash = pytest.Stash()
        self.stash[_ITEM_TIME_KEY] = (wall, cpu)

    def get_closest_marker(self, name: str) -> object | None:
        return name if name in self._marks else None

    def getparent(self, cls: type) -> None:
        return None


def test_time_is_reported_never_failed() -> None:
    """Issue 41: the fast tier's timing is a report. An unmarked test that took 5 s of both
    wall clock and CPU time (a slower machine than the one it was written on) passes with a
    line in the summary; the coqui rule still fails."""
    from conftest import SLOW_S, _marker_faults, _slow_note

    slow = _TimedItem(wall=5 * SLOW_S, cpu=5 * SLOW_S)
    assert _marker_faults(slow) == []
    assert "mark it slow" in (_slow_note(slow) or "")
    assert "one clock only" in (_slow_note(_TimedItem(wall=5 * SLOW_S, cpu=0.1)) or "")
    assert _slow_note(_TimedItem(wall=5 * SLOW_S, cpu=5 * SLOW_S, marks=("slow",))) is None
    assert _slow_note(_TimedItem(wall=0.1, cpu=0.1)) is None
    needs_coqui = _TimedItem(wall=0.1, cpu=0.1)
    needs_coqui.fixturenames = ("tiny_xtts",)
    assert any("not marked xtts" in fault for fault in _marker_faults(needs_coqui))
