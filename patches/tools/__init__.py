"""The tools layer: the ``training-patches`` command and what only its commands use.

``check-data`` (:mod:`.check_data`), ``doctor``, ``report`` (:mod:`.report`), ``run``
(:mod:`.launcher`, with the ``sitecustomize`` of :mod:`._bootstrap`), ``extend-tokenizer`` and
``verify-tokenizer`` (their library: :mod:`.tokenizer`), and the parser (:mod:`.cli`).
Tools import the patches and the integrations; nothing below imports a tool
(``tests/test_import_graph.py``), and ``import patches`` never loads this package.
"""
