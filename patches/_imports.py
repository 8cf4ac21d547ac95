"""Run a hook once a module is imported, counting a module still mid-import as not imported.

``wrapt.register_post_import_hook`` calls the hook at once for any name in ``sys.modules``,
but a module is put there *before* its body runs: a hook registered while the module is
still executing (it imported torch, and the torch hook applied the patches) would see a
half-built module, with names bound further down its body missing. :func:`when_imported`
waits for the end of that import instead.

How the end is seen: Python marks a module being imported with ``__spec__._initializing =
True`` and sets it back to False in the ``finally`` of the import (``importlib._bootstrap.
_load_unlocked``), after the body has run, whether it succeeded or failed. The spec of the
module is given, for the rest of that import only, a subclass of its own class whose
``__setattr__`` sees that assignment and runs the hooks; the spec's class is restored first.
A hook registered from inside wrapt's own post-import hook of a module (its body has run,
the flag is not reset yet) waits the same way, until that ``finally``: a moment later, still
before the user's ``import`` statement returns.
It imports nothing from :mod:`patches` (the stdlib and wrapt only): the ``training-patches
run`` bootstrap uses it while ``patches`` itself is half-imported.
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
    """Call ``hook(module)`` once ``name`` is imported: now if it is, at the end of its
    import if it is in progress, else when it is imported (``wrapt``'s post-import hook).

    A hook that raises during an import makes that import fail, as with wrapt; callers
    that must never break the user's import catch their own exceptions.
    """
    with _lock:
        module = sys.modules.get(name)
        spec = getattr(module, "__spec__", None)
        if module is not None and initializing(module) and getattr(spec, "name", None) == name:
            _waiting.setdefault(name, []).append(hook)
            if not isinstance(spec, tuple(_watching_classes.values())):
                object.__setattr__(spec, "__class__", _watching_class(type(spec)))
            return
    wrapt.register_post_import_hook(hook, name)
