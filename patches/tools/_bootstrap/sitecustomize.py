"""Started by Python in every process run under ``training-patches run``.

It applies the patches when ``torch`` is first imported (a post-import hook), so a process
that never imports torch pays nothing, then runs the ``sitecustomize`` this one shadows
(a virtual environment's or a distribution's), as ``ddtrace-run`` does. It never stops the
user's program: a failure is one line on stderr.
"""

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _activate(_torch: object) -> None:
    """The torch hook. When the program's own ``import patches`` (or ``patches.auto``) is
    what imported torch, ``patches`` is half-imported now: activation waits for the end of
    that import, since ``patches.advanced`` is bound near the bottom of ``patches/__init__``."""
    package = sys.modules.get("patches")
    try:
        from patches._imports import initializing, when_imported  # lazy: loads with torch only

        if initializing(package):
            when_imported(_activate_patches, "patches")
            return
    except Exception as exc:  # the user's program goes on, unpatched, and is told so
        _unprotected(exc)
        return
    _activate_patches(package)


def _activate_patches(_package: object) -> None:
    try:
        import patches  # lazy: patches loads once torch is imported, never at interpreter start

        patches.advanced.activate()
    except Exception as exc:  # the user's program goes on, unpatched, and is told so
        _unprotected(exc)


def _unprotected(exc: BaseException) -> None:
    sys.stderr.write(f"training-patches run: the patches could NOT be applied in process "
                     f"{os.getpid()}, interpreter {sys.executable} ({type(exc).__name__}: "
                     f"{exc}); this process trains unprotected.\n")


def _install() -> None:
    try:
        import wrapt  # lazy: inside the try, so a broken wrapt never stops the interpreter

        wrapt.register_post_import_hook(_activate, "torch")
    except Exception as exc:
        sys.stderr.write(f"training-patches run: could not watch for the torch import in "
                         f"process {os.getpid()}, interpreter {sys.executable} "
                         f"({type(exc).__name__}: {exc}); this process trains unprotected.\n")


def _run_shadowed_sitecustomize() -> None:
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    ours = sys.modules.get("sitecustomize")
    try:
        module = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = module
        spec.loader.exec_module(module)
    except Exception as exc:  # as Python itself treats a failing sitecustomize
        sys.stderr.write(f"Error in sitecustomize ({spec.origin}); set PYTHONVERBOSE for "
                         f"traceback:\n{type(exc).__name__}: {exc}\n")
    finally:
        if ours is not None:
            sys.modules["sitecustomize"] = ours


_install()
_run_shadowed_sitecustomize()
