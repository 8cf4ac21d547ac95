"""Run a hook once a module is imported, counting a module still mid-import as not imported.

``wrapt.register_post_import_hook`` runs a hook at once for a name in ``sys.modules``, but a
module is there *before* its body runs (it imported torch, whose hook applied the patches):
the hook would see it half-built. :func:`when_imported` waits for the end of that import:
Python sets ``__spec__._initializing`` back to False in the import's ``finally``
(``importlib._bootstrap._load_unlocked``), and for that import the spec's class is a subclass
whose ``__setattr__`` sees it and runs the hooks. It imports nothing from :mod:`patches`: the
``training-patches run`` bootstrap uses it while ``patches`` is half-imported.
"""

from __future__ import annotations

import sys
import threading
from types import ModuleType
from typing import Any, Callable

import wrapt

Hook = Callable[[ModuleType], None]

_lock = threading.RLock()
# Module name -> hooks waiting for the end of its import (the one now in progress).
_waiting: dict[str, list[Hook]] = {}
# The subclass made for each spec class (ModuleSpec, or a loader's own subclass of it).
_watching_classes: dict[type, type] = {}


def initializing(module: ModuleType | None) -> bool:
    """True while ``module``'s body is still running (it is in ``sys.modules`` already)."""
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def _ended(spec: Any, base: type) -> None:
    """The import of ``spec.name`` has ended: hand its hooks to wrapt, which runs them now on
    what ``sys.modules`` holds (the module, or what its body put there in its place), or,
    when the import failed and the name is gone, at the next import of the name."""
    with _lock:
        object.__setattr__(spec, "__class__", base)
        hooks = _waiting.pop(spec.name, [])
    for hook in hooks:
        wrapt.register_post_import_hook(hook, spec.name)


def _watching_class(base: type) -> type:
    cls = _watching_classes.get(base)
    if cls is None:
        def __setattr__(self: Any, name: str, value: Any) -> None:
            base.__setattr__(self, name, value)
            if name == "_initializing" and not value:
                _ended(self, base)

        cls = _watching_classes[base] = type(f"_Watching{base.__name__}", (base,),
                                             {"__setattr__": __setattr__})
    return cls


def when_imported(hook: Hook, name: str) -> None:
    """Call ``hook(module)`` once ``name`` is imported: now, at the end of its import in
    progress, or when it is imported. A hook that raises fails that import, as with wrapt."""
    with _lock:
        module = sys.modules.get(name)
        spec = getattr(module, "__spec__", None)
        if module is not None and initializing(module) and getattr(spec, "name", None) == name:
            _waiting.setdefault(name, []).append(hook)
            if not isinstance(spec, tuple(_watching_classes.values())):
                object.__setattr__(spec, "__class__", _watching_class(type(spec)))
            return
    wrapt.register_post_import_hook(hook, name)
