"""Upstream integrations: what is specific to one upstream package (its names, call sites
and supported versions), contributed to the generic patches through the registry.

Each module declares one :class:`patches._registry.Integration` (``layouts`` registers the
upstream models' vocabulary row layouts with :mod:`patches.vocab_rows` instead). Importing
an integration never imports its upstream: sites land through post-import hooks. The
trainers' and DeepSpeed's are packages whose ``sites`` module, the implementation, is
imported only when one of their sites lands (:func:`implementation`).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


def implementation(package: str
                   ) -> tuple[Callable[[str], Callable[[Any], Any]], Callable[[str], Any]]:
    """For the integration ``package`` whose ``sites`` module is its implementation:
    ``made(name)``, a Site's ``make`` that imports ``sites`` as the site lands (its upstream is
    imported by then) and runs its ``name``, and the package's ``__getattr__`` (the
    implementation's public names, on first use; not ``sites``, which the import system asks
    for before it imports it)."""
    def load() -> Any:
        return importlib.import_module(f"{package}.sites")

    def made(name: str) -> Callable[[Any], Any]:
        return lambda original: getattr(load(), name)(original)

    def __getattr__(name: str) -> Any:
        if name.startswith("_") or name == "sites":
            raise AttributeError(name)
        return getattr(load(), name)
    return made, __getattr__

from . import (accelerate, coqui_trainer, deepspeed, f5_tts, layouts, lightning,  # noqa: E402,F401
               transformers_trainer, xtts_dataset, xtts_gpt, xtts_language)
