"""The one import line: ``from utils import training_patches`` applies the patches.

Put it at the top of an existing trainer; nothing else changes. A second import does
nothing. Settings come from ``TRAINING_PATCHES_*`` environment variables
(TRAINING_PATCHES_README.md).

``utils`` here is a namespace package (no ``__init__.py``), so it never shadows a
trainer's own ``utils``: with a namespace ``utils`` in the trainer too, both merge and
``utils.gpt_train`` still comes from the trainer. With a regular ``utils`` package
(one with ``__init__.py``), copy this file into it. Either way the library itself must be
importable: ``pip install training-patches`` (or ``pip install -e`` of a checkout).
"""

import os
import sys

try:
    import patches
except ImportError as exc:
    # Run from a checkout that is not installed: the library sits beside this utils/.
    _checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.isfile(os.path.join(_checkout, "patches", "__init__.py")):
        raise ImportError(
            f"utils/training_patches.py ({os.path.abspath(__file__)}) could not import the "
            f"training-patches library: {exc}. Expected the `patches` package to be installed "
            f"or beside this utils/ folder. Install it with `pip install training-patches` "
            f"(or `pip install -e /path/to/training-patches`), or run the trainer with "
            f"`training-patches run python train.py` instead of this line.") from exc
    sys.path.insert(0, _checkout)
    import patches

applied = patches.advanced.activate()
