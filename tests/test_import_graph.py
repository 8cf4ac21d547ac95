"""The package's shape, read from its source with ``ast``: three layers, each importing only
its own and the ones below it, no private name taken from another package, nothing
imported in a cycle, every import inside a function saying why it is there (``# lazy:``),
and the installed package carries no demo or test fixture.

The layers, bottom to top:

0. generic patches: the core (``patches._*``), the patch modules, ``checkpoint/``,
   ``languages/``: torch and each other only;
1. model layouts and integrations: ``patches/integrations/`` (coqui Trainer, XTTS, ...);
2. tools: ``patches/tools/`` (the ``training-patches`` command and what only it uses).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "patches"
GENERIC, INTEGRATIONS, TOOLS = 0, 1, 2
# Entry modules outside the folders of their layer: ``import patches`` registers the
# integrations (so it sits with them) and must never load a tool; ``python -m patches`` and
# the old console-script path ``patches.cli`` are the command line.
ENTRY_LAYERS = {"patches": INTEGRATIONS, "patches.auto": INTEGRATIONS,
                "patches.__main__": TOOLS, "patches.cli": TOOLS}
# Old names of modules that moved up to the tools layer (issue 40), kept one release as
# deprecated aliases: each is the moved module itself (a package: its public names), so it
# sits in the tools layer with it, and ``import patches.auto`` reaches none of them.
DEPRECATED_ALIASES = {
    "patches.integrations.tokenizer": "patches.tools.tokenizer",
    **{f"patches.integrations.tokenizer.{name}": f"patches.tools.tokenizer.{name}"
       for name in ("bpe", "errors", "spm", "text", "verify")},
    "patches.integrations.xtts_preflight": "patches.tools.xtts_preflight",
}
# Imports of a private name (``_x``: a module, function, class or constant) from another
# package that remain today, each with why it is allowed (importer -> imported name).
PRIVATE_ALLOWED: set[str] = set()
# Upstream model names and attributes no generic module's code may hold (lower case; found
# as parts of names, attributes, import names and path-like strings): an upstream layout
# belongs in patches/integrations/ (patches.integrations.layouts for the vocabulary rows).
UPSTREAM_WORDS = ("xtts", "indextts", "start_text_token", "number_text_tokens",
                  "unifiedvoice", "gpttrainer")
# Generic modules that still hold one (module: word), each with why it is allowed. Empty: the
# tokenizer library (XTTS's vocab.json, its text cleaner) lives in patches/tools/tokenizer,
# the rules the runtime checks in patches/integrations/xtts_vocab.py.
UPSTREAM_ALLOWED: set[str] = set()

# An import inside a function hides an edge of the graph from its reader: one stays there only
# where it avoids a heavy or optional dependency (or an import cycle), and says which on its
# first line, ``# lazy: <reason>``. The files below are audited by the layouts/options change
# (issue 21, item 2); the lead empties this list when merging it.
_LAZY_AUDIT_PENDING: set[str] = set()
LAZY_REASON = re.compile(r"#\s*lazy:\s*\S")


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


class Import(NamedTuple):
    """One import statement of the package."""

    module: str  # the module holding it
    is_package: bool  # whether that module is a package's ``__init__``
    node: ast.Import | ast.ImportFrom
    local: bool  # inside a function (run on a call), not at module level
    line: str  # the source line it starts on


def _imports(modules: dict[str, Path]) -> Iterator[Import]:
    """Every import statement of the package, function-local ones included."""
    for name, path in modules.items():
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        todo: list[tuple[ast.AST, bool]] = [(ast.parse(source), False)]
        while todo:
            node, local = todo.pop()
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                yield Import(name, path.name == "__init__.py", node, local,
                             lines[node.lineno - 1])
                continue
            inner = local or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                               ast.Lambda))
            todo += [(child, inner) for child in ast.iter_child_nodes(node)]


def _targets(found: Import) -> list[str]:
    """The names an import statement may bind a package module to."""
    if isinstance(found.node, ast.Import):
        return [alias.name for alias in found.node.names]
    return _resolve(found.module, found.is_package, found.node)


def import_graph(*, local: bool = True) -> dict[str, set[str]]:
    """Module -> the package modules it imports; function-local imports (run on a call)
    only with ``local``."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for found in _imports(modules):
        if local or not found.local:
            graph[found.module] |= {target for target in _targets(found)
                                    if target in modules and target != found.module}
    return graph


def layer(name: str) -> int:
    """The layer of a module (see the module docstring)."""
    if name in ENTRY_LAYERS:
        return ENTRY_LAYERS[name]
    if name in DEPRECATED_ALIASES:
        return TOOLS
    for prefix, level in (("patches.tools", TOOLS), ("patches.integrations", INTEGRATIONS)):
        if name == prefix or name.startswith(prefix + "."):
            return level
    return GENERIC


def upward_edges(graph: dict[str, set[str]]) -> list[str]:
    """``src -> dst`` for each import of a higher layer. A module's own parent packages do
    not count: Python runs them before the module anyway (``from . import x``)."""
    return sorted(f"{src} -> {dst}" for src, dsts in graph.items() for dst in dsts
                  if layer(dst) > layer(src) and not src.startswith(dst + "."))


def test_no_module_imports_a_layer_above_its_own() -> None:
    """Generic patches never import an integration or a tool; integrations never a tool."""
    assert upward_edges(import_graph()) == []


def test_the_layer_rule_can_fail() -> None:
    graph = {"patches.nan_guard": {"patches.integrations.coqui_trainer"},
             "patches.integrations.xtts_gpt": {"patches.tools.report"},
             "patches.checkpoint.load": {"patches", "patches._api"},  # parent: not counted
             "patches.tools.cli": {"patches.integrations", "patches.nan_guard"}}
    assert upward_edges(graph) == [
        "patches.integrations.xtts_gpt -> patches.tools.report",
        "patches.nan_guard -> patches.integrations.coqui_trainer"]


def _unit(name: str, packages: set[str]) -> str:
    """The top-level package a module belongs to: ``patches.checkpoint``, ``patches.tools``,
    ... or ``patches`` for the modules directly in it."""
    parts = name.split(".")
    return ".".join(parts[:2]) if ".".join(parts[:2]) in packages else "patches"


def private_imports() -> list[str]:
    """``importer -> name`` for each private name taken from another package: a private
    module (``_x``) imported from outside the package holding it (the core modules
    ``patches._*`` belong to the whole package, so every subpackage may use them), or a
    private function, class or constant imported from another top-level package."""
    modules = _modules()
    packages = {name for name, path in modules.items() if path.name == "__init__.py"}
    found: set[str] = set()
    for statement in _imports(modules):
        name, node = statement.module, statement.node
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = _resolve(name, statement.is_package, node)[0]
            targets = [f"{base}.{alias.name}" for alias in node.names]
        for target in targets:
            parts = target.split(".")
            if parts[0] != "patches":
                continue
            for i, part in enumerate(parts[1:], start=1):
                if not part.startswith("_") or part.startswith("__"):
                    continue
                owner = ".".join(parts[:i])  # the module or package holding the name
                if owner in packages:  # a private module: only inside its package
                    allowed = name == owner or name.startswith(owner + ".")
                else:  # a private attribute: only inside the owner's top-level package
                    allowed = _unit(owner, packages) == _unit(name, packages)
                if not allowed:
                    found.add(f"{name} -> {'.'.join(parts[:i + 1])}")
    return sorted(found)


def test_no_private_name_is_imported_across_packages() -> None:
    assert sorted(set(private_imports()) - PRIVATE_ALLOWED) == []
    # an entry whose import is gone is dropped from the list, so the list stays true
    assert sorted(PRIVATE_ALLOWED - set(private_imports())) == []


# The module whose class owns the ``_tp_*`` attributes it defines: SafeGradScaler's state.
SCALER_MODULE = "patches.grad_scaler"


def private_reads(sources: dict[str, str]) -> list[str]:
    """``module: what`` for each private attribute a module reads from another patch
    module (``nan_guard._state``: ``x._name`` where ``x`` is an imported ``patches``
    module that is not a core ``patches._*`` one), and for each ``_tp_*`` attribute of
    SafeGradScaler (those :data:`SCALER_MODULE` defines) named anywhere else. What the
    patches tell each other within a step goes through ``patches._step`` and public
    methods (docs/design/step.md)."""
    trees = {name: ast.parse(source) for name, source in sources.items()}
    scaler_own = {node.attr for node in ast.walk(trees.get(SCALER_MODULE, ast.Module([], [])))
                  if isinstance(node, ast.Attribute) and node.attr.startswith("_tp_")}
    found: set[str] = set()
    for name, tree in trees.items():
        bound: dict[str, str] = {}  # local name -> the patch module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                package = any(other.startswith(name + ".") for other in sources)
                base = _resolve(name, package, node)[0]
                bound.update({alias.asname or alias.name: f"{base}.{alias.name}"
                              for alias in node.names})
            elif isinstance(node, ast.Import):
                bound.update({alias.asname: alias.name for alias in node.names if alias.asname})
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") \
                    or node.attr.startswith("__"):
                continue
            if name != SCALER_MODULE and node.attr in scaler_own:
                found.add(f"{name}: .{node.attr}")
            owner = bound.get(node.value.id) if isinstance(node.value, ast.Name) else None
            if (owner is not None and owner != name and owner in sources
                    and not owner.rsplit(".", 1)[-1].startswith("_")):
                found.add(f"{name}: {node.value.id}.{node.attr}")
    return sorted(found)


def test_no_module_reads_another_patch_modules_privates() -> None:
    """grad_clip asks the scaler through ``unscaled_param_ids()`` / ``scale_tensor()``, the
    coqui integration asks the guard through ``nan_guard.replaying()``."""
    sources = {name: path.read_text(encoding="utf-8") for name, path in _modules().items()}
    assert private_reads(sources) == []


def test_the_private_read_rule_can_fail() -> None:
    sources = {
        SCALER_MODULE: "class S:\n    def f(self):\n        self._tp_unscaled = set()\n",
        "patches.grad_clip": "def f(scaler):\n    return scaler._tp_unscaled\n",
        "patches.nan_guard": "_state = None\n",
        "patches._run": "batch_ids = []\n",
        "patches.integrations.coqui_trainer": (
            "from .. import _run, nan_guard\n"
            "def f():\n    return nan_guard._state.replaying, _run._x, nan_guard.replaying()\n"),
    }
    assert private_reads(sources) == ["patches.grad_clip: ._tp_unscaled",
                                      "patches.integrations.coqui_trainer: nan_guard._state"]


def reached(graph: dict[str, set[str]], start: str = "patches.auto") -> set[str]:
    """The modules ``start`` may load: its imports and theirs, with the parent packages each
    one runs first."""
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]
        todo += [*graph.get(name, ()), *parents]
    return seen


def test_import_patches_auto_loads_no_tool() -> None:
    """``import patches.auto`` (and so ``import patches``) never reaches a tool module (issue
    40): not the command line (``patches.tools``, ``patches.cli``, its output rules
    ``patches.tools._output``), not the tokenizer tools, not headlessXttsTrain.py's pre-flight,
    nor their old names, by a module-level import nor by one inside a function (run on a
    call: a freeze checked against a tokenizer reads it with the runtime's own
    ``integrations.xtts_vocab``)."""
    for local in (False, True):
        seen = reached(import_graph(local=local))
        assert sorted(n for n in seen if layer(n) == TOOLS) == []
        assert "patches.integrations.coqui_trainer" in seen  # the walk reaches the patches


def test_the_reach_rule_can_fail() -> None:
    graph = {"patches.auto": {"patches._api"}, "patches._api": {"patches.checkpoint.atomic"},
             "patches.checkpoint.atomic": {"patches.tools._output"},
             "patches.integrations.xtts_gpt": {"patches.integrations.tokenizer.verify"}}
    assert sorted(n for n in reached(graph) if layer(n) == TOOLS) == ["patches.tools",
                                                                     "patches.tools._output"]
    graph["patches._api"].add("patches.integrations.xtts_gpt")
    assert "patches.integrations.tokenizer.verify" in reached(graph)
    assert layer("patches.integrations.tokenizer.verify") == TOOLS


def test_the_moved_modules_answer_to_their_old_names() -> None:
    """Each old name is the moved module itself (one module object: one class of each
    error), with a DeprecationWarning; nothing else lives in the alias files."""
    import importlib
    import warnings

    modules = _modules()
    assert set(DEPRECATED_ALIASES) <= set(modules)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for old, new in DEPRECATED_ALIASES.items():
            sys.modules.pop(old, None)
            moved = importlib.import_module(new)
            if old == "patches.integrations.tokenizer":
                assert importlib.import_module(old).TokenizerToolError is moved.TokenizerToolError
            else:
                assert importlib.import_module(old) is moved, old
    assert any(issubclass(w.category, DeprecationWarning) for w in caught)
    for old in DEPRECATED_ALIASES:
        assert len(modules[old].read_text(encoding="utf-8").splitlines()) < 20, old


def _lines_printed_by(code: str) -> list[str]:
    """The lines ``code`` prints in a fresh, quiet interpreter that imports this tree."""
    env = {"TRAINING_PATCHES_QUIET": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
           "PYTHONPATH": str(PACKAGE.parent)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300, check=True)
    return done.stdout.splitlines()


@pytest.mark.slow
def test_a_command_imports_only_its_own_tool() -> None:
    """In a fresh interpreter: ``import patches.auto`` loads no tool module, and the parser
    built for one command (as ``training-patches doctor`` builds it) loads that command's
    module and the CLI only."""
    code = ("import sys\n"
            "import patches.auto\n"
            "print(sorted(m for m in sys.modules if m.startswith(('patches.tools', 'patches.cli',"
            " 'patches._output', 'patches.integrations.tokenizer', "
            "'patches.integrations.xtts_preflight'))))\n"
            "from patches.tools import cli\n"
            "cli.build_parser(cli.command_of(['doctor', '--json', '-']))\n"
            "print(sorted(m for m in sys.modules if m.startswith('patches.tools')))\n")
    after_auto, after_parser = _lines_printed_by(code)
    assert after_auto == "[]"
    assert after_parser == str(["patches.tools", "patches.tools._output", "patches.tools.cli",
                                "patches.tools.doctor"])


# What ``import patches.auto`` loads of patches/checkpoint (issue 41): the patch's own site
# (the DataLoader position), the errors and the RNG capture; the loader, the manager and what
# they use load on the first use of one of their names.
CHECKPOINT_AT_IMPORT = ["patches.checkpoint.data_position", "patches.checkpoint.errors",
                        "patches.checkpoint.rng"]


@pytest.mark.slow
def test_import_patches_auto_leaves_the_checkpoint_loader_for_its_first_use() -> None:
    """In a fresh interpreter: ``import patches.auto`` loads only
    :data:`CHECKPOINT_AT_IMPORT` of patches/checkpoint; the first use of a lazy name
    (``patches.load_checkpoint``) loads the loader, and is the object it always was."""
    code = ("import sys, torch\n"
            "import patches.auto\n"
            "print(sorted(m for m in sys.modules if m.startswith('patches.checkpoint.')))\n"
            "import patches\n"
            "from patches.checkpoint import load\n"
            "print(patches.load_checkpoint is load.load_checkpoint)\n")
    assert _lines_printed_by(code) == [str(CHECKPOINT_AT_IMPORT), "True"]


# What ``import patches.auto`` loads of patches/integrations: the coqui Trainer's and XTTS's
# integrations whole, the other trainers' and DeepSpeed's declarations alone (their
# Integration and sites); each one's implementation, its ``sites`` module (and the
# ``trainers`` helpers they share), loads when one of its sites lands, once its upstream is
# imported (issue 40, item 5).
INTEGRATIONS_AT_IMPORT = ["patches.integrations"] + [f"patches.integrations.{name}" for name in (
    "accelerate", "coqui_checkpoint", "coqui_interrupt", "coqui_learning", "coqui_trainer",
    "deepspeed", "f5_tts", "layouts", "lightning", "transformers_trainer", "xtts_dataset",
    "xtts_gpt", "xtts_language")]


def test_import_patches_auto_loads_no_integrations_implementation() -> None:
    """The module-level imports ``import patches.auto`` runs reach no integration's
    implementation: only :data:`INTEGRATIONS_AT_IMPORT` of patches/integrations."""
    seen = reached(import_graph(local=False))
    assert sorted(n for n in seen if n.startswith("patches.integrations")) == \
        INTEGRATIONS_AT_IMPORT


@pytest.mark.slow
def test_an_integrations_implementation_loads_with_its_upstream() -> None:
    """In a fresh interpreter: ``import patches.auto`` loads only
    :data:`INTEGRATIONS_AT_IMPORT` of patches/integrations; importing Lightning lands its
    sites, which loads the lightning integration's implementation and nothing of the
    others'."""
    pytest.importorskip("lightning")
    code = ("import sys, torch\n"
            "import patches.auto\n"
            "def loaded():\n"
            "    return sorted(m for m in sys.modules if m.startswith('patches.integrations'))\n"
            "print(loaded())\n"
            "import lightning.pytorch\n"
            "print(sorted(set(loaded()) - set(" + repr(INTEGRATIONS_AT_IMPORT) + ")))\n")
    assert _lines_printed_by(code) == [str(INTEGRATIONS_AT_IMPORT), str(
        ["patches.integrations.lightning.sites", "patches.integrations.trainers"])]


def test_the_checkpoint_packages_lazy_names_are_its_submodules_own() -> None:
    """``patches.checkpoint`` (and ``patches``, ``patches.advanced``) name their lazy names'
    modules right: each answers with its submodule's object, every submodule answers as an
    attribute, and ``dir()`` and ``__all__`` hold them."""
    import importlib

    import patches
    import patches.advanced
    import patches.checkpoint as checkpoint

    files = {path.stem for path in (PACKAGE / "checkpoint").glob("*.py")} - {"__init__"}
    assert checkpoint._SUBMODULES == files
    for name in files:
        assert getattr(checkpoint, name) is importlib.import_module(f"patches.checkpoint.{name}")
    for name, module in checkpoint._LAZY.items():
        owner = importlib.import_module(f"patches.checkpoint.{module}")
        assert getattr(checkpoint, name) is getattr(owner, name), name
    assert set(checkpoint.__all__) <= set(dir(checkpoint))
    for name in patches._LAZY:
        assert getattr(patches, name) is getattr(checkpoint, name), name
    assert set(patches.__all__) <= set(dir(patches))
    assert patches.advanced.LoadOptions is checkpoint.LoadOptions
    assert set(patches.advanced.__all__) <= set(dir(patches.advanced))
    with pytest.raises(AttributeError):
        checkpoint.no_such_name  # noqa: B018


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


def test_every_import_of_the_package_names_a_module_that_exists() -> None:
    """An import of ``patches.x`` (relative or absolute, inside a function too) names a
    module of the package: a module moved without its importers fails here, not at the
    call that runs the import (a function-local import is only run on a call)."""
    modules = _modules()
    broken = []
    for found in _imports(modules):
        bases = ([alias.name for alias in found.node.names] if isinstance(found.node, ast.Import)
                 else [_resolve(found.module, found.is_package, found.node)[0]])
        broken += [f"{found.module}:{found.node.lineno} imports {base}" for base in bases
                   if (base == "patches" or base.startswith("patches.")) and base not in modules]
    assert not broken, broken


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants of a parsed module, its classes and functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                found.add(id(first.value))
    return found


def upstream_mentions(source: str) -> set[str]:
    """The words of :data:`UPSTREAM_WORDS` that ``source``'s code holds: in a name, an
    attribute, a definition, an argument, an imported name, or a string constant without
    whitespace (a path, key or attribute name such as ``"xtts.gpt"``). Comments, docstrings
    and prose (a message naming a model as an example) do not count."""
    tree = ast.parse(source)
    skip = _docstrings(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            texts = [node.id]
        elif isinstance(node, ast.Attribute):
            texts = [node.attr]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            texts = [node.name]
        elif isinstance(node, ast.arg):
            texts = [node.arg]
        elif isinstance(node, ast.keyword):
            texts = [node.arg or ""]
        elif isinstance(node, ast.alias):
            texts = [node.name, node.asname or ""]
        elif isinstance(node, ast.ImportFrom):
            texts = [node.module or ""]
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in skip and not any(c.isspace() for c in node.value)):
            texts = [node.value]
        else:
            continue
        found |= {word for text in texts for word in UPSTREAM_WORDS if word in text.lower()}
    return found


def test_generic_modules_hold_no_upstream_model_knowledge() -> None:
    """A generic module's code names no upstream model or model attribute: XTTS's
    ``start_text_token``, IndexTTS's ``number_text_tokens``, the paths their owners sit at
    are registered by the integrations (:mod:`patches.integrations.layouts`)."""
    found = {f"{name}: {word}" for name, path in _modules().items() if layer(name) == GENERIC
             for word in upstream_mentions(path.read_text(encoding="utf-8"))}
    assert sorted(found - UPSTREAM_ALLOWED) == []
    # an entry whose mention is gone is dropped from the list, so the list stays true
    assert sorted(UPSTREAM_ALLOWED - found) == []


def test_the_upstream_rule_can_fail() -> None:
    """What the rule finds and what it lets pass."""
    code = ('"""An XTTS docstring."""\n'
            "# an XTTS comment\n"
            "XTTS_START_LAST = 1\n"
            "def f(owner):\n"
            "    return getattr(owner, 'start_text_token')\n"
            "PATHS = ('gpt', 'xtts.gpt')\n"
            "owner.number_text_tokens\n"
            "from ..integrations.layouts import UnifiedVoice\n"
            "raise ValueError('expected an IndexTTS model, or a GPTTrainer')\n")
    assert upstream_mentions(code) == {"xtts", "start_text_token", "number_text_tokens",
                                       "unifiedvoice"}


def unexplained_local_imports(modules: dict[str, Path]) -> list[str]:
    """``module:line statement`` for each import inside a function whose first line gives
    no ``# lazy: <reason>``."""
    return sorted(f"{found.module}:{found.node.lineno} {found.line.strip()}"
                  for found in _imports(modules)
                  if found.local and not LAZY_REASON.search(found.line))


def test_every_import_inside_a_function_says_why_it_is_lazy() -> None:
    """An import that avoids no heavy or optional dependency (nor a cycle) sits at the top
    of its module, where the reader sees the graph; the others name what they avoid."""
    modules = {name: path for name, path in _modules().items()
               if name not in _LAZY_AUDIT_PENDING}
    assert unexplained_local_imports(modules) == []


def test_the_lazy_rule_can_fail(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import os\n\n"
                      "def f():\n    import json\n\n"
                      "def g():\n    import numpy  # lazy: numpy is heavy\n\n"
                      "class C:\n    def h(self):\n        from . import (x,  # lazy:\n"
                      "            y)  # lazy: cycle\n", encoding="utf-8")
    assert unexplained_local_imports({"patches.m": module}) == [
        "patches.m:11 from . import (x,  # lazy:", "patches.m:4 import json"]


def test_run_file_names_are_declared_once() -> None:
    """The files the patches write into a run's folder are named in patches/_run.py only:
    the patches that write them and the report that reads them take the names from there
    (a name spelled twice drifts apart, and the report then misses a file)."""
    from patches import _run

    spelled: dict[str, list[str]] = {name: [] for name in _run.OWN_FILES}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in spelled:
                spelled[node.value].append(str(path.relative_to(PACKAGE)))
    assert spelled == {name: ["_run.py"] for name in _run.OWN_FILES}
