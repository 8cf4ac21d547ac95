"""``resume_check``: at the first optimizer step after a resume, do the LR, the scheduler and
the optimizer's state still fit together?

Two of the seeds' lost runs were resumes that trained on: losses stuck from step 4k to 11k (an
optimizer state that did not match the grown vocabulary), and an LR that *decayed* (4.78e-5 ->
4.54e-5) where a warmup was due (a fresh optimizer with the old scheduler). At the first step of
each optimizer after a resume (seen by itself, announced by :func:`expect_resume`, or re-armed by
a later ``optimizer.load_state_dict``) it compares the optimizer's step count and moments'
shapes, its LR and its scheduler's, and their step counts with the trainer's: one WARNING and a
``resume`` record in ``learning_health.jsonl`` per problem, one INFO line when they fit. It
reads and never changes anything.

Design: docs/design/learning.md ("The resume check")
"""

from __future__ import annotations

import gc
import math
import weakref
from typing import Any

import torch

from . import _run, _step
from ._log import info, logger
from ._registry import PatchSpec, register

LR_TOLERANCE = 0.01  # relative: an LR 1% off its scheduler's was not set by it
STEP_TOLERANCE = 0.01  # relative, at least 2 steps: skipped steps may hold a scheduler back

# Optimizers whose load_state_dict re-arms the check (a hook on the user's object, for
# its life: wiring, not run state).
_load_hooks: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()


class _Resumes:
    """The run's checks: which optimizers were checked, the resume announced, the counts."""

    def __init__(self) -> None:
        self.checked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self.armed: dict[str, Any] = {}  # expect_resume: the next step of every optimizer
        self.counts = {"resumes_checked": 0, "resume_problems": 0}


def _resumes() -> _Resumes:
    return _run.current().part(_Resumes)


def expect_resume(step: int | None = None, *, scheduler_step: int | None = None,
                  source: str = "") -> None:
    """A resume just happened (``source``: who says so): the next optimizer step is checked
    even when nothing looks loaded. ``step``: the trainer's step the run continues from (for
    the messages); ``scheduler_step``: where the scheduler should be in its own count (the
    optimizer steps, or the epochs of a per-epoch scheduler): its step count and the LR of
    its plan there are compared (None: not compared, e.g. a step count of batches under
    gradient accumulation, or steps a loss scaler skipped without the scheduler)."""
    resumes = _resumes()
    resumes.armed.update(step=step, scheduler_step=scheduler_step, source=source)
    resumes.checked.clear()


def optimizer_steps(optimizer: torch.optim.Optimizer) -> int | None:
    """The steps ``optimizer`` has taken, from its state (``step``); 0 with no state; None
    when its state keeps no count (plain SGD)."""
    if not optimizer.state:
        # plain SGD keeps no state at all (without momentum), loaded or not: no count to read
        return None if isinstance(optimizer, torch.optim.SGD) else 0
    counts = []
    for state in optimizer.state.values():
        value = state.get("step") if isinstance(state, dict) else None
        if value is not None:
            counts.append(int(value.item() if isinstance(value, torch.Tensor) else value))
    return max(counts) if counts else None


def schedulers_of(optimizer: torch.optim.Optimizer) -> list[Any]:
    """The LR schedulers driving ``optimizer`` (outermost: not a SequentialLR's child)."""
    kind = torch.optim.lr_scheduler.LRScheduler

    def drives(scheduler: Any) -> bool:
        # the optimizer itself, or a wrapper of it (accelerate's AcceleratedOptimizer, which
        # the HF Trainer's scheduler holds, keeps the torch optimizer as .optimizer)
        held = getattr(scheduler, "optimizer", None)
        return held is optimizer or getattr(held, "optimizer", None) is optimizer
    # type(), not isinstance(): the latter asks __class__ of lazy deprecated proxies
    found = [obj for obj in gc.get_objects() if issubclass(type(obj), kind) and drives(obj)]
    inner = {id(child) for s in found for child in getattr(s, "_schedulers", ())}
    return [s for s in found if id(s) not in inner]


def planned_lr(scheduler: Any, step: int) -> list[float] | None:
    """The LRs ``scheduler``'s own plan gives after ``step`` steps, where it has a closed
    form (LambdaLR, StepLR, MultiStepLR, Cosine, Linear, Exponential, ...); else None."""
    if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        return [base * fn(step) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    closed = getattr(scheduler, "_get_closed_form_lr", None)
    if closed is None:
        return None
    saved = scheduler.last_epoch
    try:
        scheduler.last_epoch = step
        return [float(lr) for lr in closed()]
    except Exception:  # noqa: BLE001 - a plan we cannot read is no finding
        return None
    finally:
        scheduler.last_epoch = saved


def _apart(a: float, b: float) -> bool:
    return not math.isclose(a, b, rel_tol=LR_TOLERANCE, abs_tol=1e-12)


def _lrs(values: list[float]) -> str:
    return ", ".join(f"{v:.3g}" for v in values) if len(set(values)) > 1 else f"{values[0]:.3g}"


def _moment_mismatches(optimizer: torch.optim.Optimizer) -> list[str]:
    """``name shape -> moment shape`` for parameters whose state tensors do not fit them."""
    out = []
    for group in optimizer.param_groups:
        for index, p in enumerate(group["params"]):
            state = optimizer.state.get(p)
            if not isinstance(state, dict):
                continue
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != p.shape:
                    out.append(f"parameter {index} of its group {tuple(p.shape)} has "
                               f"{key} {tuple(value.shape)}")
                    break
    return out


def check(optimizer: torch.optim.Optimizer, *, step: int | None = None,
          scheduler_step: int | None = None, forced: bool = False,
          source: str = "") -> list[str] | None:
    """Compare ``optimizer``, its scheduler and the trainer's ``step``; log and record. Returns
    the problems found (``[]``: the parts fit), or None when this was no resume (nothing
    loaded, and ``forced`` not set). The scheduler's step count is compared with
    ``scheduler_step`` where one is given (:func:`expect_resume`)."""
    steps = optimizer_steps(optimizer)
    scheds = schedulers_of(optimizer)
    sched = scheds[0] if len(scheds) == 1 else None
    s = int(sched.last_epoch) if sched is not None else None
    if not (forced or (steps or 0) > 0 or (s or 0) >= 2):
        return None  # a fresh start: nothing was loaded
    lr = [float(g["lr"]) for g in optimizer.param_groups]
    where = f"step {step:,}" if step is not None else (
        f"optimizer step {steps:,}" if steps else "the first step")
    problems: list[str] = []
    kinds: list[str] = []
    moments = _moment_mismatches(optimizer)
    if moments:
        kinds.append("moments")
        problems.append(
            f"the optimizer's state does not fit its parameters ({len(moments)} tensor(s): "
            f"{moments[0]}): it was saved for other shapes (a vocabulary that grew since); "
            f"torch's step will fail or train on moments of other rows. Load it with "
            f"patches.load_checkpoint, which grows the moments with the rows")
    sched_lr = [float(v) for v in sched.get_last_lr()] if sched is not None else None
    if sched is not None and steps == 0 and s is not None and s >= 1:
        kinds.append("fresh_optimizer")
        problems.append(
            f"at {where} the scheduler continues an old schedule (its step {s:,}, LR "
            f"{_lrs(sched_lr)}; this step uses {_lrs(lr)}), but the optimizer is fresh: its "
            f"step count is 0 and its moments start from zero at that LR, with no warmup. Load "
            f"the optimizer's state with the scheduler's, or restart the schedule with its "
            f"warmup")
    elif sched_lr is not None and len(sched_lr) == len(lr) and any(
            _apart(a, b) for a, b in zip(lr, sched_lr)):
        kinds.append("lr_not_scheduler")
        if s == 0 and (steps or 0) > 0:
            why = (f"the scheduler restarted (its step count is 0) while the optimizer has "
                   f"taken {steps:,} steps: the LR was loaded with the optimizer's state and "
                   f"jumps to the schedule's start ({_lrs(sched_lr)}) at the next step")
        else:
            why = (f"the two were loaded from different places (the scheduler is at its step "
                   f"{s:,}, the optimizer at {steps if steps is not None else 'an unknown'} "
                   f"step(s))")
        problems.append(f"the optimizer's LR {_lrs(lr)} at {where} is not the one its "
                        f"scheduler set ({_lrs(sched_lr)}): {why}. Load the optimizer and the "
                        f"scheduler from one checkpoint")
    target = scheduler_step
    planned = planned_lr(sched, target) if sched is not None and target is not None else None
    if (sched is not None and s is not None and target is not None
            and "fresh_optimizer" not in kinds
            and abs(s - target) > max(0 if target < 100 else 2, STEP_TOLERANCE * target)):
        kinds.append("scheduler_steps")
        plan = (f"; its plan gives LR {_lrs(planned)} there, the optimizer has {_lrs(lr)}"
                if planned is not None else "")
        problems.append(
            f"the scheduler is at its step {s:,} while the run resumes where it should be at "
            f"{target:,}{f' (trainer step {step:,})' if step is not None else ''}: it "
            f"{'restarted' if s < target else 'skipped ahead'}{plan}. Restore the scheduler "
            f"from the checkpoint the trainer's step came from")
    counts = _resumes().counts
    counts["resumes_checked"] += 1
    counts["resume_problems"] += len(problems)
    path = _run.record_in(_run.report_dir(), _run.LEARNING_FILE, "resume", step=step,
                          optimizer_steps=steps, scheduler_steps=s, lr=lr,
                          scheduler_lr=sched_lr, planned_lr=planned,
                          scheduler_expected=scheduler_step, problems=kinds,
                          details=problems, schedulers=len(scheds), source=source or None)
    for problem in problems:
        logger.warning("resume_check: %s (%s)", problem, _run.where_recorded(path))
    if not problems:
        info("resume_check: resume at %s: LR %s %s, the optimizer has taken %s step(s), its "
             "moments fit the parameters", where, _lrs(lr),
             "is its scheduler's" if sched is not None else
             "(no LR scheduler found)" if not scheds
             else f"({len(scheds)} schedulers: not compared)",
             f"{steps:,}" if steps is not None else "an unknown number of")
    return problems


def _check_stage(optimizer: torch.optim.Optimizer) -> None:
    """The step pipeline's first stage: an optimizer's first step (after a start, a resume
    or a ``load_state_dict``) is compared before anything of the step changes it."""
    resumes = _resumes()
    if optimizer in resumes.checked:
        return
    resumes.checked.add(optimizer)
    _step.context().mark("resume_check")
    if optimizer not in _load_hooks:  # a later load_state_dict re-arms the check
        _load_hooks.add(optimizer)
        optimizer.register_load_state_dict_post_hook(lambda opt: _resumes().checked.discard(opt))
    armed = dict(resumes.armed)
    resumes.armed.clear()  # one resume, one check
    step = armed.get("step")
    try:
        check(optimizer, step=step if step is not None else _run.current().trainer_step,
              scheduler_step=armed.get("scheduler_step"), forced=bool(armed),
              source=armed.get("source", ""))
    except Exception as exc:  # noqa: BLE001 - a check must never end the run
        logger.warning("resume_check: the check itself failed (%s: %s); training goes on "
                       "unchecked", type(exc).__name__, exc)


def _enable(options: Any) -> None:
    _step.set_stage("check_resume", _check_stage)


def _disable() -> None:
    _step.set_stage("check_resume", None)


def stats() -> dict[str, int]:
    """``resumes_checked``: first steps after a resume compared; ``resume_problems``."""
    return dict(_resumes().counts)


SPEC = register(PatchSpec(
    name="resume_check",
    describe=lambda o: ("at the first step after a resume: the LR against its scheduler's, "
                        "their step counts, the moments' shapes against the parameters"),
    enable=_enable,
    disable=_disable,
    stats=stats,
))

__all__ = ["expect_resume", "check", "optimizer_steps", "schedulers_of", "planned_lr", "stats"]
