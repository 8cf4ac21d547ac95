"""The apply phase of a single-file load: :func:`apply` carries out a :class:`LoadPlan`: the
parts beside the model first (:func:`.parts.apply_state`: optimizer, scheduler, scaler,
RNG, runtime counters, data position, EMA weights, each with its undo), the model last.
When torch still refuses something, everything changed is put back before one
:class:`CheckpointError` is raised."""

from __future__ import annotations

import logging
from typing import Callable

import torch

from .decide import LoadPlan
from .errors import CheckpointError
from .parts import apply_state
from .reading import _what_to_do
from .report import LoadReport

logger = logging.getLogger("training_patches")


def apply(plan: LoadPlan, model: torch.nn.Module, report: LoadReport) -> list[str]:
    """Change the objects as ``plan`` says, all or nothing; ``report`` gets what was
    restored or reset (``restored``, ``reset``, ``step``, ``rng_restored``,
    ``runtime_state_restored``). Returns the model keys ``load_state_dict`` found missing.

    Raises :class:`CheckpointError` after putting back what was changed (the model's
    weights, changed last, may stay partly changed; the message says so)."""
    undo: list[Callable[[], None]] = []
    model_touched = False
    try:
        apply_state(plan.state, report, undo)  # the EMA weights among them
        # The model last: everything it could refuse was checked by decide().
        model_touched = True
        missing, _ = model.load_state_dict(plan.model.state, strict=False)
    except Exception as exc:  # noqa: BLE001 - put everything back, then one clear error
        for step_back in reversed(undo):
            try:
                step_back()
            except Exception:  # noqa: BLE001 - keep undoing the rest
                logger.exception("training-patches: could not undo part of a refused load")
        what = ("The optimizer, scheduler, scaler and RNG were put back as they were, but the "
                "model's weights may be partly changed: build the model again before retrying."
                if model_touched else "Nothing was changed.")
        raise CheckpointError(
            f"training-patches: cannot load {plan.path}: torch refused part of it after it passed "
            f"every check ({type(exc).__name__}: {str(exc)[:300]}). {what} "
            f"{_what_to_do(plan.path)}") from exc
    return list(missing)
