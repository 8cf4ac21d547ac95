"""training-patches: numerically safe, resumable fine-tuning of TTS GPT models.

Importing this package changes nothing; :func:`apply` and :func:`revert` are the
only doors. ``from utils import training_patches`` (or ``import patches.auto``)
applies the default set once. See TRAINING_PATCHES_README.md.

Layout, in three layers (``tests/test_import_graph.py``): the generic patches (one module
each, with the core ``_*`` modules, ``checkpoint`` and ``languages``) import torch and each
other; :mod:`patches.integrations` adds what is specific to one upstream (coqui Trainer,
XTTS) on top of them; :mod:`patches.tools` (the ``training-patches`` command) sits above
both and is never imported from here.
"""

from __future__ import annotations

from ._version import __version__  # noqa: E402,F401

# Each patch module registers its PatchSpec; the order here is the banner's order.
from . import (  # noqa: E402,F401
    autocast, grad_scaler, grad_clip, nan_guard, anomaly, checkpoint, vocab_freeze, languages,
    dataset_guard, oom_guard, learning, resume_check)
from . import integrations  # noqa: E402,F401  (registers the upstream integrations)
from ._api import (  # noqa: E402
    activate, applied, apply, get_original, is_applied, reset_runtime_state, revert, stats,
    status)
from ._options import ConfigError  # noqa: E402
from ._registry import PatchSiteError  # noqa: E402
from .languages import register_language  # noqa: E402
from .anomaly import enable_anomaly_detection  # noqa: E402
from .checkpoint import (  # noqa: E402
    CheckpointError, CheckpointManager, CheckpointMismatchError, CheckpointWriteError,
    DiskFullError, LoadOptions, LoadReport, UnsafeCheckpointError, load_checkpoint)
from .grad_clip import safe_clip_grad_norm_  # noqa: E402
from .grad_scaler import LossScaleFloorError, SafeGradScaler  # noqa: E402
from .vocab_freeze import freeze_base_vocab  # noqa: E402
from .nan_guard import NonFiniteTrainingError, find_nonfinite_source, observe_loss  # noqa: E402
from ._run import set_output_dir  # noqa: E402
from ._runlock import RunFolderInUse  # noqa: E402
from .oom_guard import OutOfMemoryTrainingError, skip_on_oom  # noqa: E402
from .learning import LearningMonitor, ReadingProbe  # noqa: E402

__all__ = [
    "apply", "revert", "applied", "is_applied", "status", "get_original", "stats", "activate",
    "reset_runtime_state", "enable_anomaly_detection", "SafeGradScaler", "LossScaleFloorError",
    "safe_clip_grad_norm_", "ConfigError", "PatchSiteError", "__version__",
    "register_language", "load_checkpoint", "LoadOptions", "CheckpointManager", "LoadReport",
    "CheckpointError", "UnsafeCheckpointError", "CheckpointMismatchError", "DiskFullError",
    "CheckpointWriteError",
    "NonFiniteTrainingError", "find_nonfinite_source", "observe_loss", "set_output_dir",
    "freeze_base_vocab", "OutOfMemoryTrainingError", "skip_on_oom", "RunFolderInUse",
    "LearningMonitor", "ReadingProbe",
]
