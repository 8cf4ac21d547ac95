"""``anomaly``: torch's autograd anomaly detection as a switch (off by default).

Anomaly mode names the forward operation whose backward produced NaN, at a cost
of 2.4-3x per step: turn it on to hunt a NaN, never for a whole run.
``TRAINING_PATCHES_ANOMALY=1`` turns it on at activation;
``enable_anomaly_detection()`` does it from code and, used as a context manager,
restores the previous state on exit.
"""

from __future__ import annotations

from types import TracebackType

import torch

from ._log import logger
from ._options import Option, flag
from ._registry import PatchSpec, register


class enable_anomaly_detection:  # noqa: N801 - used like torch's set_detect_anomaly
    """Turn autograd anomaly detection on (or off) now; restore the old state on ``with`` exit."""

    def __init__(self, on: bool = True, check_nan: bool = True) -> None:
        self.previous = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
        torch.autograd.set_detect_anomaly(on, check_nan)
        if on:
            logger.warning("autograd anomaly detection is ON: every step is 2.4-3x slower; "
                           "turn it off once the NaN is found")

    def __enter__(self) -> enable_anomaly_detection:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        torch.autograd.set_detect_anomaly(*self.previous)


_active: enable_anomaly_detection | None = None


def _enable(options: object) -> None:
    global _active
    _active = enable_anomaly_detection(True)


def _disable() -> None:
    global _active
    if _active is not None:
        _active.__exit__(None, None, None)
        _active = None


SPEC = register(PatchSpec(
    name="anomaly",
    describe=lambda o: "autograd anomaly detection ON (2.4-3x slower; for hunting a NaN)",
    default=False,
    enable=_enable,
    disable=_disable,
    off_hint="off by default; TRAINING_PATCHES_ANOMALY=1 turns it on",
    options=(Option("anomaly", flag, False, "1 or 0",
                    "1: autograd anomaly detection on (2.4-3x slower)"),),
))
