"""``training-patches check-data``: a coqui dataset checked before training."""
from .checks import *  # noqa: F401,F403  (until the split: the next commit)
