"""``python -m patches``: the ``training-patches`` command."""

from patches.tools.cli import main

raise SystemExit(main())
