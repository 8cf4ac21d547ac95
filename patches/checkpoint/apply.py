"""The apply phase of a single-file load: :func:`apply` carries out a :class:`LoadPlan` on
the optimizer, scheduler, scaler, RNG, runtime counters and, last, the model, recording
an undo for each change. When torch still refuses something, everything changed is put
back before one :class:`CheckpointError` is raised."""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any, Callable

import torch

from .decide import LoadPlan
from .errors import CheckpointError
from .optimizer import (_detach_from_file, _restart_scaler, _restart_scheduler,
                        restore_optimizer, scaler_enabled, snapshot_optimizer)
from .reading import _what_to_do
from .report import LoadReport, restarted
from .rng import capture_rng_state, restore_rng_state

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
        if plan.effective == "remap":
            _apply_remap(plan, report, undo)
        else:
            _apply_reset(plan, report, undo)
        if plan.rng is not None:
            undo.append(lambda s=capture_rng_state(): restore_rng_state(s))
            restore_rng_state(plan.rng)
            report.rng_restored = True
        if plan.runtime is not None:
            # _api imports every runtime patch; imported from this package it would load (and
            # register) oom_guard before checkpoint, reordering specs() and status()
            from .. import _api  # lazy: import order of the patches (see above)

            undo.append(lambda s=_api.runtime_state(): _api.load_runtime_state(s))
            _api.load_runtime_state(plan.runtime)
            report.runtime_state_restored = True
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


def _apply_remap(plan: LoadPlan, report: LoadReport, undo: list[Callable[[], None]]) -> None:
    """Load the saved optimizer (moments grown), scheduler and scaler states."""
    for state, opt in zip(plan.optimizer_states, plan.optimizers):
        snap = snapshot_optimizer(opt)
        undo.append(lambda o=opt, s=snap: restore_optimizer(o, s))
        opt.load_state_dict(state)
        _detach_from_file(opt.state)
    if plan.optimizers:
        report.restored.append("optimizer")
    if plan.schedulers and plan.saved_scheds:
        for state, sched in zip(plan.saved_scheds, plan.schedulers):
            undo.append(lambda o=sched, s=dict(sched.__dict__): _restore_dict(o, s))
            sched.load_state_dict(dict(state))
        report.restored.append("scheduler")
    elif plan.schedulers:
        report.reset.append("scheduler (not in the checkpoint)")
    scaler = plan.scaler
    if plan.scaler_on:
        if plan.saved_scaler:
            snap_scaler = scaler.state_dict()
            if snap_scaler:
                undo.append(lambda s=snap_scaler: scaler.load_state_dict(s))
            scaler.load_state_dict(dict(plan.saved_scaler))
            report.restored.append("scaler")
        else:
            report.reset.append("scaler (not in the checkpoint)")


def _apply_reset(plan: LoadPlan, report: LoadReport, undo: list[Callable[[], None]]) -> None:
    """Start the optimizer, scheduler and scaler fresh together; the run resumes at 0."""
    for opt in plan.optimizers:
        snap = snapshot_optimizer(opt)
        undo.append(lambda o=opt, s=snap: restore_optimizer(o, s))
        opt.state = defaultdict(dict)
        for group in opt.param_groups:
            if "initial_lr" in group:
                group["lr"] = group["initial_lr"]
    for sched in plan.schedulers:
        undo.append(lambda o=sched, s=dict(sched.__dict__): _restore_dict(o, s))
        _restart_scheduler(sched)
    scaler = plan.scaler
    if scaler is not None:
        snap_scaler = scaler.state_dict() if scaler_enabled(scaler) else None
        if snap_scaler:
            undo.append(lambda s=snap_scaler: scaler.load_state_dict(s))
        _restart_scaler(scaler)
    report.reset += restarted(plan.optimizers, plan.schedulers, scaler)
    report.step = 0


def _restore_dict(obj: Any, saved: dict[str, Any]) -> None:
    obj.__dict__.clear()
    obj.__dict__.update(saved)
