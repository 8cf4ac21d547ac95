"""training-patches: numerically safe, resumable fine-tuning of TTS GPT models.

Importing this package changes nothing; :func:`patches.advanced.apply` and :func:`revert`
are the only doors. ``from utils import training_patches`` (or ``import patches.auto``)
applies the default set once. See TRAINING_PATCHES_README.md.

The public core (``__all__``) is what a user of an XTTS fine-tune needs; :mod:`patches.advanced`
holds every other public name (their old top-level spellings answer as deprecated aliases for
one release: :func:`__getattr__`). Layout, in three layers (``tests/test_import_graph.py``):
the generic patches and the core ``_*`` modules; :mod:`patches.integrations` on top of them;
:mod:`patches.tools` (the ``training-patches`` command) above both, never imported from here.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from ._version import __version__  # noqa: E402,F401

# Each patch module registers its PatchSpec; the order here is the banner's order.
from . import (  # noqa: E402,F401
    autocast, grad_scaler, grad_clip, nan_guard, anomaly, checkpoint, vocab_freeze, languages,
    dataset_guard, oom_guard, learning, resume_check)
from . import integrations  # noqa: E402,F401  (registers the upstream integrations)
from ._api import revert, stats, status  # noqa: E402
from .checkpoint import (  # noqa: E402
    CheckpointError, CheckpointMismatchError, CheckpointWriteError, DiskFullError,
    UnsafeCheckpointError)
from ._runlock import RunFolderInUse  # noqa: E402
from . import advanced  # noqa: E402

if TYPE_CHECKING:  # loaded on first use by __getattr__ (_LAZY)
    from .checkpoint import CheckpointManager, LoadReport, load_checkpoint  # noqa: F401

__all__ = [
    "load_checkpoint", "CheckpointManager", "stats", "status", "revert", "__version__",
    "LoadReport", "CheckpointError", "CheckpointMismatchError", "UnsafeCheckpointError",
    "DiskFullError", "CheckpointWriteError", "RunFolderInUse", "advanced",
]

# The top-level names of 0.x that moved to patches.advanced (issue 40): deprecated aliases
# for one release. A name added to patches.advanced later never becomes one.
_MOVED = frozenset((
    "apply", "applied", "is_applied", "get_original", "activate", "reset_runtime_state",
    "enable_anomaly_detection", "SafeGradScaler", "LossScaleFloorError", "safe_clip_grad_norm_",
    "ConfigError", "PatchSiteError", "register_language", "LoadOptions",
    "NonFiniteTrainingError", "find_nonfinite_source", "observe_loss", "set_output_dir",
    "freeze_base_vocab", "OutOfMemoryTrainingError", "skip_on_oom", "LearningMonitor",
    "ReadingProbe"))
_warned_aliases: set[str] = set()
# Core names whose module (patches.checkpoint) loads on their first use (issue 41).
_LAZY = frozenset(("CheckpointManager", "LoadReport", "load_checkpoint"))


def __getattr__(name: str) -> object:
    """``patches.<old name>`` is ``patches.advanced.<old name>``, with one DeprecationWarning
    per name per process; a name of :data:`_LAZY` is ``patches.checkpoint``'s, imported on
    first use and kept (PEP 562)."""
    if name in _LAZY:
        value = globals()[name] = getattr(checkpoint, name)
        return value
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _warned_aliases:
        _warned_aliases.add(name)
        warnings.warn(f"patches.{name} is patches.advanced.{name}; the old name goes in the "
                      f"next release", DeprecationWarning, stacklevel=2)
    return getattr(advanced, name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
