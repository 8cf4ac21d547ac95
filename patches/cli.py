"""Old home of the ``training-patches`` command, now :mod:`patches.tools.cli`.

Kept because a console script written by ``pip install`` before the move runs
``from patches.cli import main`` until the package is installed again.
"""

from patches.tools.cli import main  # noqa: F401

__all__ = ["main"]
