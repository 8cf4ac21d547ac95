"""``patches._imports.when_imported``: a module still running its body counts as not yet
imported; the hook runs at the end of that import, on the whole module."""

from __future__ import annotations

import importlib.machinery
import sys
from pathlib import Path
from types import ModuleType

import pytest

from patches import _imports

# The module registers a hook for itself halfway through its body (as the torch hook does
# for a module that imports torch before binding its own names).
BODY = """\
import tp_probe_hooks
tp_probe_hooks.register(__name__)
FIRST = 1
{fail}
LATER = 2
{end}
"""
# A module that puts another object in its place in sys.modules (lazy-loading packages do).
REPLACED = "import sys, types\nsys.modules[__name__] = types.ModuleType(__name__)"


@pytest.fixture
def modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Write modules into a folder on sys.path; each run's hook records what it saw."""
    seen: list[tuple[str, bool, bool]] = []
    hooks = ModuleType("tp_probe_hooks")

    def register(name: str) -> None:
        _imports.when_imported(
            lambda m: seen.append((m.__name__, hasattr(m, "LATER"), _imports.initializing(m))),
            name)

    hooks.register = register  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tp_probe_hooks", hooks)
    monkeypatch.syspath_prepend(str(tmp_path))
    written: list[str] = []

    def write(name: str, fail: bool = False, end: str = "") -> None:
        (tmp_path / f"{name}.py").write_text(
            BODY.format(fail="raise RuntimeError('broken on purpose')" if fail else "", end=end))
        importlib.invalidate_caches()
        written.append(name)

    yield write, seen
    for name in written:
        sys.modules.pop(name, None)


def test_a_hook_registered_mid_import_sees_the_whole_module(modules) -> None:
    write, seen = modules
    write("tp_probe_mid")
    import tp_probe_mid  # noqa: F401

    assert seen == [("tp_probe_mid", True, False)]
    # the spec is its own class again once the import is over
    assert type(sys.modules["tp_probe_mid"].__spec__) is importlib.machinery.ModuleSpec


def test_an_imported_module_runs_the_hook_at_once(modules) -> None:
    write, seen = modules
    write("tp_probe_done")
    import tp_probe_done  # noqa: F401

    seen.clear()
    _imports.when_imported(lambda m: seen.append((m.__name__, True, False)), "tp_probe_done")
    assert seen == [("tp_probe_done", True, False)]


def test_a_failed_import_leaves_the_hook_for_the_next_import(modules) -> None:
    write, seen = modules
    write("tp_probe_fail", fail=True)
    with pytest.raises(RuntimeError, match="broken on purpose"):
        import tp_probe_fail  # noqa: F401
    assert seen == []
    write("tp_probe_fail")
    import tp_probe_fail  # noqa: F401,F811

    # the hook of the failed import (handed to wrapt, run as the body ends) and the one
    # this import registered: both on the whole module
    assert [(name, whole) for name, whole, _ in seen] == [("tp_probe_fail", True)] * 2


def test_a_module_replaced_in_sys_modules_hands_the_hook_its_replacement(modules) -> None:
    write, seen = modules
    write("tp_probe_replaced", end=REPLACED)
    import tp_probe_replaced

    # what the import statement returned is what the hook saw (it has no LATER)
    assert seen == [("tp_probe_replaced", False, False)]
    assert not hasattr(tp_probe_replaced, "LATER")
