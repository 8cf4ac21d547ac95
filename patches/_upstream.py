"""Which version of an upstream package this process runs, or will import: the imported
module's ``__version__``, else the copy ``import`` would find (the installed distribution's
metadata, or a vendored package's ``__version__``/``VERSION`` read from its files without
importing it). Read by the registry (an integration's supported range, the banner) and
``training-patches doctor``; stdlib only.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlparse


@functools.lru_cache(maxsize=None)
def _distribution(distribution: str) -> importlib.metadata.Distribution | None:
    """The installed distribution, or None: found once per process (a search of ``sys.path``)."""
    try:
        return importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=None)
def distribution_version(distribution: str) -> str | None:
    """The installed distribution's version, read from its metadata's header (importlib's
    parse of the whole file costs about 1 ms a package, issue 41)."""
    dist = _distribution(distribution)
    if dist is None:
        return None
    text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or ""
    for line in text.split("\n\n", 1)[0].splitlines():  # the header ends at a blank line
        if line.startswith("Version:"):
            return line[len("Version:"):].strip() or dist.version
    return dist.version


_RELEASE = re.compile(r"\d+(?:\.\d+)*")
_CLAUSE = re.compile(r"\s*(>=|<=|==|<|>)\s*(\d+(?:\.\d+)*)\s*")


def version_in(version: str, supported: str) -> bool:
    """Whether ``version`` is in the PEP 440 range ``supported``: plain releases against
    ``>=``/``<``/``<=``/``>``/``==`` clauses here, anything else by ``packaging`` (~5 ms to
    import), whose InvalidVersion (a ValueError) says a version it cannot read."""
    clauses = [_CLAUSE.fullmatch(clause) for clause in supported.split(",")]
    if _RELEASE.fullmatch(version) and all(clauses):
        have = [int(part) for part in version.split(".")]
        for match in clauses:
            bound = [int(part) for part in match.group(2).split(".")]
            width = max(len(have), len(bound))
            a, b = (tuple(parts + [0] * (width - len(parts))) for parts in (have, bound))
            if not {">=": a >= b, "<=": a <= b, "==": a == b, "<": a < b,
                    ">": a > b}[match.group(1)]:
                return False
        return True
    from packaging.specifiers import SpecifierSet  # lazy: ~5 ms, only for an unusual version
    from packaging.version import Version  # lazy: as above

    return Version(version) in SpecifierSet(supported)


@dataclass(frozen=True)
class UpstreamVersion:
    """The version of an integration's upstream that this process runs (or will import):
    ``source`` where it was read, in short (the banner), ``detail`` with the path;
    ``vendored``: not the installed distribution's copy (a trainer shipping its own ``TTS/``)."""

    version: str | None
    source: str
    detail: str
    vendored: bool = False


def _package_dir(origin: str | None) -> str:
    if not origin:
        return "?"
    return os.path.dirname(origin) if os.path.basename(origin) == "__init__.py" else origin


@functools.lru_cache(maxsize=None)
def _is_distributions_copy(distribution: str, module: str, origin: str | None) -> bool:
    """True when ``origin`` (a module's file) is the one ``distribution`` installed."""
    dist = _distribution(distribution)
    if dist is None:
        return False
    if not origin:
        return True  # a namespace package: nothing to tell apart
    target = os.path.realpath(origin)
    if any(os.path.realpath(str(dist.locate_file(candidate))) == target
           for candidate in (f"{module}/__init__.py", f"{module}.py")):
        return True
    source = _editable_source(dist)
    return source is not None and target.startswith(source + os.sep)


def _editable_source(dist: importlib.metadata.Distribution) -> str | None:
    """The source folder of an editable install (PEP 610's ``direct_url.json``), or None."""
    try:
        info = json.loads(dist.read_text("direct_url.json") or "{}")
    except (ValueError, OSError):
        return None
    url = urlparse(str(info.get("url", "")))
    if not (info.get("dir_info") or {}).get("editable") or url.scheme != "file":
        return None
    return os.path.realpath(unquote(url.path))


def _static_version(package_dir: str) -> str | None:
    """``__version__ = "x.y"`` in a package's ``__init__.py``, else its ``VERSION`` file
    (coqui TTS 0.22 reads that one): read without importing the package."""
    try:
        tree = ast.parse(open(os.path.join(package_dir, "__init__.py"), encoding="utf-8").read())
    except (OSError, SyntaxError, ValueError):
        tree = None
    for node in getattr(tree, "body", []):
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets) and \
                isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return node.value.value
    try:
        text = open(os.path.join(package_dir, "VERSION"), encoding="utf-8").read().strip()
    except OSError:
        return None
    return text.splitlines()[0].strip() if text else None


def upstream_version(integ: Any) -> UpstreamVersion:
    """The version of ``integ``'s upstream this process runs (see the module's docstring)."""
    meta = distribution_version(integ.distribution)
    name = integ.module
    if not name:
        return UpstreamVersion(meta, "package metadata", "package metadata")
    module = sys.modules.get(name)
    if module is not None:
        origin = getattr(module, "__file__", None)
        where, version = _package_dir(origin), getattr(module, "__version__", None)
        vendored = not _is_distributions_copy(integ.distribution, name, origin)
        if isinstance(version, str) and version:
            return UpstreamVersion(version, f"{name}.__version__",
                                   f"{name}.__version__ of the imported {name} at {where}",
                                   vendored)
        return UpstreamVersion(
            None if vendored else meta,
            f"{name} has no __version__" + ("" if vendored else "; package metadata"),
            f"the imported {name} at {where} has no __version__"
            + (f" and is not {integ.distribution}'s installed copy, so its version is unknown"
               if vendored else f"; read from {integ.distribution}'s package metadata"),
            vendored)
    try:
        spec = importlib.util.find_spec(name)  # a top-level name: finds, imports nothing
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return UpstreamVersion(None, f"{name} not importable",
                               f"no {name} package can be imported")
    origin = spec.origin if spec.origin not in (None, "namespace") else None
    if _is_distributions_copy(integ.distribution, name, origin):
        return UpstreamVersion(meta, f"package metadata; {name} not imported yet",
                               f"{integ.distribution}'s package metadata ({name} not "
                               f"imported yet)")
    where = _package_dir(origin)
    version = _static_version(where)
    return UpstreamVersion(
        version, f"{name} at {where}, not imported yet",
        f"the {name} that will be imported is {where}, not {integ.distribution}'s installed "
        f"copy" + (f" ({meta})" if meta else "")
        + (f"; its version {version} read from its files" if version else
           "; its version could not be read before it is imported"), True)


__all__ = ["UpstreamVersion", "distribution_version", "upstream_version", "version_in"]
