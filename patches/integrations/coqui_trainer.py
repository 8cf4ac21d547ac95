"""coqui-tts-trainer (package ``trainer``, 0.4): the names it binds and calls.

``trainer/trainer.py`` binds ``GradScaler = functools.partial(torch.GradScaler,
device="cuda")`` at its own import time, so patching torch's names alone does not
reach it; it calls ``torch.nn.utils.clip_grad_norm_`` by attribute at call time.
"""

from __future__ import annotations

import functools
from typing import Any

SUPPORTED = "coqui-tts-trainer >= 0.3, < 0.5"
MODULE = "trainer.trainer"
SCALER_ATTR = "GradScaler"


def scaler_factory(safe_cls: type, original: Any) -> Any:
    """The trainer's ``GradScaler`` binding with ``safe_cls`` in place of torch's class."""
    if isinstance(original, functools.partial):
        return functools.partial(safe_cls, *original.args, **original.keywords)
    return functools.partial(safe_cls, device="cuda")
