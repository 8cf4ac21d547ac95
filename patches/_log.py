"""The library's logger and the routine-line helper that honours ``quiet``."""

from __future__ import annotations

import logging

from . import _options

logger = logging.getLogger("training_patches")


def info(msg: str, *args: object) -> None:
    """A routine line: INFO, or DEBUG when ``TRAINING_PATCHES_QUIET=1``."""
    logger.log(logging.DEBUG if _options.current().quiet else logging.INFO, msg, *args)
