"""Module docstrings stay short, and every design page or file they name exists.

A module's docstring says what the module is for, its public names and, where the design
needs more than that, ``Design: docs/design/<name>.md``: the essays (the problem, the
mechanism, what was measured) live in docs/design/, one page per patch, indexed by
docs/design/README.md. Read from the source with ``ast`` and the docs as text; nothing is
imported.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "patches"
DESIGN = ROOT / "docs" / "design"
# A module whose design has a page in docs/design/ needs only a few lines: what it is for,
# its public names, the pointer.
POINTER_MAX_LINES = 15
# Any other public module: past this its docstring is an essay and belongs in docs/design/
# (the four essays moved out were 46-67 lines; the longest docstring kept today is 28).
ESSAY_MAX_LINES = 30
DESIGN_REF = re.compile(r"docs/design/[\w.-]+\.md")
MD_NAME = re.compile(r"[\w./-]*[\w-]\.md\b")
# The user-facing docs a reader of the repository follows, checked for names of .md files.
DOCS = ("README.md", "TRAINING_PATCHES_README.md", "docs", "tests/clients/README.md")
# .md files the docs name that a command writes (they are not in the repository).
GENERATED = {
    "gpu_suite.md": "written by `make gpu-suite` (benchmarks/gpu/results/)",
    "table.md": "written by benchmarks/bench_new_language.py into its --out folder",
}


def _modules() -> Iterator[Path]:
    yield from sorted(PACKAGE.rglob("*.py"))


def _is_private(path: Path) -> bool:
    """``patches/_x.py`` or anything under a ``_x/`` package (``__init__``/``__main__`` are
    the package itself)."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return any(part.startswith("_") and part not in ("__init__", "__main__") for part in parts)


def _docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False) or ""


def _all_docstrings(path: Path) -> Iterator[str]:
    """The docstrings of the module, its classes and its functions."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield doc


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _doc_files() -> list[Path]:
    files: list[Path] = []
    for name in DOCS:
        path = ROOT / name
        files.extend(sorted(path.rglob("*.md")) if path.is_dir() else [path])
    return files


def _design_pages() -> list[Path]:
    return sorted(page for page in DESIGN.glob("*.md") if page.name != "README.md")


def test_no_public_module_docstring_is_an_essay() -> None:
    too_long = []
    for path in _modules():
        if _is_private(path):
            continue
        doc = _docstring(path)
        lines = len(doc.splitlines())
        limit = POINTER_MAX_LINES if DESIGN_REF.search(doc) else ESSAY_MAX_LINES
        if lines > limit:
            too_long.append(f"{_rel(path)}: {lines} lines (at most {limit})")
    assert not too_long, (
        "These module docstrings have grown into essays: " + "; ".join(too_long) + ". A module "
        "docstring says what the module is for, its public names and, for a patch with a design "
        "page, 'Design: docs/design/<name>.md' (at most "
        f"{POINTER_MAX_LINES} lines then, {ESSAY_MAX_LINES} otherwise). Move the problem, the "
        "mechanism and what was measured to docs/design/<name>.md (see docs/design/README.md) "
        "and leave the pointer.")


def test_every_design_page_a_docstring_names_exists() -> None:
    missing = sorted({f"{_rel(path)} names {ref}"
                      for path in _modules() for doc in _all_docstrings(path)
                      for ref in DESIGN_REF.findall(doc) if not (ROOT / ref).is_file()})
    assert not missing, (
        "A docstring points to a design page that does not exist: " + "; ".join(missing) +
        ". Expected each 'docs/design/<name>.md' to be a file of the repository: write the page "
        "(and list it in docs/design/README.md) or correct the name.")


def test_every_md_file_a_module_docstring_names_is_in_the_repository() -> None:
    """A reader of the repository can follow every .md a module docstring names (the
    project's notes outside the repository, such as its style guide, are not there)."""
    missing = []
    for path in _modules():
        for name in MD_NAME.findall(_docstring(path)):
            if not any((base / name).is_file() for base in (ROOT, PACKAGE, path.parent)):
                missing.append(f"{_rel(path)} names {name}")
    assert not missing, (
        "A module docstring names a .md file that is not in the repository: " +
        "; ".join(missing) + ". Say in the docstring what the reference stood for, or point to "
        "a file of the repository (a path from its root, e.g. docs/design/<name>.md).")


def test_every_md_file_the_docs_name_is_in_the_repository() -> None:
    missing = []
    for doc in _doc_files():
        for name in MD_NAME.findall(doc.read_text(encoding="utf-8")):
            if Path(name).name in GENERATED:
                continue
            if not any((base / name).is_file() for base in (ROOT, doc.parent)):
                missing.append(f"{_rel(doc)} names {name}")
    assert not missing, (
        "The docs name .md files that are not in the repository: " + "; ".join(sorted(set(
            missing))) + ". Expected a path from the repository's root or from the document's "
        "folder; say what the reference stood for instead, or list a file a command writes in "
        "GENERATED (tests/test_design_docs.py) with the command.")


def test_every_design_page_is_indexed_and_pointed_to_from_the_code() -> None:
    index = (DESIGN / "README.md").read_text(encoding="utf-8")
    named = {ref for path in _modules() for doc in _all_docstrings(path)
             for ref in DESIGN_REF.findall(doc)}
    unindexed = [page.name for page in _design_pages() if f"]({page.name})" not in index]
    orphans = [_rel(page) for page in _design_pages() if _rel(page) not in named]
    assert _design_pages(), f"no design page in {_rel(DESIGN)}"
    assert not unindexed, (
        f"docs/design/README.md does not link {', '.join(unindexed)}: add a row "
        "'| [<name>.md](<name>.md) | <module> | <in short> |' for each.")
    assert not orphans, (
        f"No docstring under patches/ points to {', '.join(orphans)}: add "
        "'Design: docs/design/<name>.md' to the docstring of the module it describes.")
