"""Demo material that is not part of the installed library: the tiny XTTS builders the tests
and ``headlessXttsTrain.py --demo`` use (:mod:`demo.xtts_tiny`), the demo driver
(:mod:`demo.xtts_demo`) and a one-minute CPU loop showing the AMP patches
(:mod:`demo.cpu_demo`, ``python -m demo.cpu_demo``). Importing any of them changes nothing."""
