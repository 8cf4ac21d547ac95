"""Upstream integrations: what is specific to one upstream package (its names, call sites
and supported versions), contributed to the generic patches through the registry.

Each module declares one :class:`patches._registry.Integration` (``layouts`` registers the
upstream models' vocabulary row layouts with :mod:`patches.vocab_rows` instead). Importing
an integration never imports its upstream: sites land through post-import hooks.
"""

from . import (accelerate, coqui_trainer, deepspeed, f5_tts, layouts, lightning,  # noqa: F401
               transformers_trainer, xtts_dataset, xtts_gpt, xtts_language)
