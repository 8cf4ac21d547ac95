"""Deprecated alias of :mod:`patches.tools.xtts_preflight` (issue 40: ``headlessXttsTrain.py``'s
input checks moved to the tools layer): this name is the moved module itself for one release."""

from __future__ import annotations

import sys
import warnings

from ..tools import xtts_preflight

warnings.warn("patches.integrations.xtts_preflight moved to patches.tools.xtts_preflight; the "
              "old name is a deprecated alias for one release", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = xtts_preflight
