"""The one import line: ``from utils import training_patches`` applies the patches.

Put it at the top of an existing trainer; nothing else changes. A second import
does nothing. Settings come from ``TRAINING_PATCHES_*`` environment variables
(TRAINING_PATCHES_README.md). Works with the ``patches`` package installed
(``pip install training-patches``) or next to this ``utils/`` folder.
"""

import os
import sys

try:
    import patches
except ImportError:  # a copied checkout: the library sits beside utils/
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import patches

applied = patches.activate()
