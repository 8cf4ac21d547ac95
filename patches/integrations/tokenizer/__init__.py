"""Deprecated alias of :mod:`patches.tools.tokenizer` (issue 40: the tokenizer tools moved to
the tools layer, so that ``import patches.auto`` never carries them). ``import
patches.integrations.tokenizer.bpe`` (and ``.errors``, ``.spm``, ``.text``, ``.verify``) still
gives the moved module itself, with a DeprecationWarning, for one release."""

from __future__ import annotations

import warnings

from ...tools.tokenizer import TokenizerToolError

warnings.warn("patches.integrations.tokenizer moved to patches.tools.tokenizer; the old name "
              "is a deprecated alias for one release", DeprecationWarning, stacklevel=2)

__all__ = ["TokenizerToolError"]
