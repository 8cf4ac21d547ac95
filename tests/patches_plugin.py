"""pytest plugin (loaded from pyproject.toml): leave no patch applied between tests."""

from __future__ import annotations

from typing import Iterator

import pytest


@pytest.fixture(autouse=True)
def _fresh_runtime_state() -> Iterator[None]:
    """Every test starts with no counters, events or run folder left by another."""
    import patches

    patches.advanced.reset_runtime_state()
    yield
    patches.advanced.reset_runtime_state()


@pytest.fixture
def clean_patches() -> Iterator[None]:
    """Start with no patch applied and revert whatever the test applied."""
    import patches
    from patches import _options

    patches.revert()
    _options.set_current(None)  # as before any apply(): the environment's, at each use
    yield
    patches.revert()
    _options.set_current(None)
