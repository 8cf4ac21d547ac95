"""``python -m patches``: the ``training-patches`` command."""

from patches.cli import main

raise SystemExit(main())
