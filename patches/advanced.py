"""``patches.advanced``: everything beyond the core, for a user who runs the patches by hand.

The core (``patches.__all__``) is what a user of an XTTS fine-tune needs; this module holds
the rest, each name the same object it always was: choosing patches and options by hand
(:func:`apply`, :func:`activate`, ...), a plain loop's own scaler, clip and freeze, the
learning monitor, languages and runtime inspection. Until the next release each name also
answers at the top level (``patches.apply``: a deprecated alias, one ``DeprecationWarning``
per name per process). Importing this module changes nothing, as ``import patches``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._api import (
    activate, applied, apply, get_original, is_applied, reset_runtime_state)
from ._options import ConfigError
from ._registry import PatchSiteError
from ._run import set_output_dir
from .anomaly import enable_anomaly_detection
from .grad_clip import safe_clip_grad_norm_
from .grad_scaler import LossScaleFloorError, RanksDivergedError, SafeGradScaler
from .languages import register_language
from .learning import LearningMonitor, ReadingProbe
from .nan_guard import NonFiniteTrainingError, find_nonfinite_source, observe_loss
from .oom_guard import OutOfMemoryTrainingError, skip_on_oom
from .vocab_freeze import freeze_base_vocab
from . import checkpoint

if TYPE_CHECKING:  # loaded on first use by __getattr__
    from .checkpoint import LoadOptions

__all__ = [
    "apply", "activate", "applied", "is_applied", "get_original", "ConfigError",
    "PatchSiteError", "LoadOptions",
    "SafeGradScaler", "LossScaleFloorError", "RanksDivergedError", "safe_clip_grad_norm_",
    "freeze_base_vocab", "observe_loss", "find_nonfinite_source", "NonFiniteTrainingError",
    "skip_on_oom", "OutOfMemoryTrainingError", "set_output_dir", "LearningMonitor",
    "ReadingProbe", "register_language", "enable_anomaly_detection", "reset_runtime_state",
]


def __getattr__(name: str) -> object:
    """``LoadOptions`` is ``patches.checkpoint``'s, loaded on first use (issue 41), kept."""
    if name != "LoadOptions":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = checkpoint.LoadOptions
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), "LoadOptions"})
