"""training-patches: numerically safe, resumable fine-tuning of TTS GPT models.

Importing this package changes nothing; :func:`apply` and :func:`revert` are the
only doors. ``from utils import training_patches`` (or ``import patches.auto``)
applies the default set once. See TRAINING_PATCHES_README.md.
"""

from __future__ import annotations

__version__ = "0.1.0"

# Each patch module registers its PatchSpec; the order here is the banner's order.
from . import autocast, grad_scaler, grad_clip, nan_guard, anomaly, checkpoint, vocab_freeze  # noqa: E402,F401,E501
from .integrations import coqui_checkpoint  # noqa: E402,F401  (registers "checkpoint")
from .integrations import xtts_language, xtts_dataset  # noqa: E402,F401
from ._api import (  # noqa: E402
    activate, applied, apply, get_original, is_applied, revert, stats)
from ._options import ConfigError  # noqa: E402
from .languages import register_language  # noqa: E402
from .anomaly import enable_anomaly_detection  # noqa: E402
from .checkpoint import (  # noqa: E402
    CheckpointError, CheckpointManager, CheckpointMismatchError, LoadReport,
    UnsafeCheckpointError, load_checkpoint)
from .grad_clip import safe_clip_grad_norm_  # noqa: E402
from .grad_scaler import LossScaleFloorError, SafeGradScaler  # noqa: E402
from .vocab_freeze import freeze_base_vocab  # noqa: E402
from .nan_guard import NonFiniteTrainingError, find_nonfinite_source, observe_loss  # noqa: E402
from ._run import set_output_dir  # noqa: E402

__all__ = [
    "apply", "revert", "applied", "is_applied", "get_original", "stats", "activate",
    "enable_anomaly_detection", "SafeGradScaler", "LossScaleFloorError",
    "safe_clip_grad_norm_", "ConfigError", "__version__", "register_language",
    "load_checkpoint", "CheckpointManager", "LoadReport", "CheckpointError",
    "UnsafeCheckpointError", "CheckpointMismatchError",
    "NonFiniteTrainingError", "find_nonfinite_source", "observe_loss", "set_output_dir",
    "freeze_base_vocab",
]
