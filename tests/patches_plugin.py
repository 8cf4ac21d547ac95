"""pytest plugin (loaded from pyproject.toml): each test is a run of its own."""

from __future__ import annotations

from typing import Iterator

import pytest


@pytest.fixture(autouse=True)
def fresh_run() -> Iterator[None]:
    """Every test starts with no patch applied and a new run (no options, counters, events,
    run folder or step context left by another test), and leaves none: ``revert()`` of
    every patch ends the run, ``reset_runtime_state()`` starts the next. A freeze another
    test made on a model still alive is taken off (it would show in ``status()``)."""
    import patches
    from patches.vocab_freeze import live_freezes

    def fresh() -> None:
        patches.revert()
        for handle in live_freezes():
            handle.remove()
        patches.advanced.reset_runtime_state()

    fresh()
    yield
    fresh()
