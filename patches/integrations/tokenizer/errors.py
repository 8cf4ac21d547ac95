"""Deprecated alias of :mod:`patches.tools.tokenizer.errors` (issue 40): this name is the moved
module itself for one release."""

from __future__ import annotations

import sys

from ...tools.tokenizer import errors

sys.modules[__name__] = errors
