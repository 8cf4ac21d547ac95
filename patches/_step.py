"""The step pipeline: everything the library does within one optimizer step, in one place.

The library's only global optimizer hooks are :func:`before_step` and :func:`after_step`
here: they run the stages of a step (:class:`Stages`) in a fixed order written in code,
whatever order the patches were applied or reverted in. Each optimizer gets one
:class:`Step` at its first step: what the stages hand each other within its step. What acts
before the step exists (the backward wrapper, the freeze's gradient hooks, the clip, the
scaler, the LR scheduler's hold) runs where the user's code calls it and hands its result
to the pipeline through :func:`context`. :data:`PHASES` are the marks of
:meth:`StepContext.recording` (off by default).

Design: docs/design/step.md
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from typing import Any, Callable, Iterator

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook, register_optimizer_step_pre_hook)

from . import _runstate

PHASES = ("backward", "unscale", "clip", "resume_check", "decide", "hold", "step", "skip",
          "keep", "record")


class StepContext:
    """What the patches tell each other within one optimizer step (a part of the run:
    :func:`context`). The scaler's ``stepping`` flag is per thread (the optimizer step it
    covers runs in one); the rest is run-wide, as a training step is driven from one thread."""

    def __init__(self) -> None:
        # grad_scaler writes, grad_clip and nan_guard read: the SafeGradScaler whose scale()
        # ran last and whose update() has not yet (weak: a dropped scaler is no longer pending)
        self._scaler: weakref.ref[Any] | None = None
        # the SafeGradScaler that scaled a loss last (its stats are the scaler's stats)
        self._latest: weakref.ref[Any] | None = None
        self._local = threading.local()  # .stepping: inside the scaler's optimizer.step()
        # grad_clip writes, nan_guard takes (once): the latest clip's gradient ids and its
        # non-finite flag on the device, so one reduction serves the clip and the guard
        self._clip: tuple[frozenset[int], torch.Tensor] | None = None
        # The phases as they run, while recording(); None (the default) records nothing.
        self.phases: list[str] | None = None

    # -- the scaler (written by grad_scaler) ---------------------------------------

    def scaler_scaled(self, scaler: Any) -> None:
        """``scaler`` scaled a loss: it is pending until its ``update()``."""
        self._scaler = self._latest = weakref.ref(scaler)

    def scaler_updated(self, scaler: Any) -> None:
        """``scaler.update()`` ran: it is no longer pending, and the iteration ends."""
        if self._scaler is not None and self._scaler() is scaler:
            self._scaler = None
        for listener in _listeners:
            listener()

    def pending_scaler(self) -> Any | None:
        """The SafeGradScaler that scaled a loss this iteration and has not updated yet."""
        return self._scaler() if self._scaler is not None else None

    def latest_scaler(self) -> Any | None:
        """The SafeGradScaler that scaled a loss last in this run (None: none, or dropped)."""
        return self._latest() if self._latest is not None else None

    @property
    def scaler_stepping(self) -> bool:
        """True inside an ``optimizer.step()`` a SafeGradScaler runs after its own finite
        check: the step is protected, the guard adds no second check."""
        return getattr(self._local, "stepping", False)

    @scaler_stepping.setter
    def scaler_stepping(self, value: bool) -> None:
        self._local.stepping = value

    # -- the clip (written by grad_clip, taken by nan_guard) ----------------------

    def put_clip(self, grads: list[torch.Tensor], nonfinite: torch.Tensor) -> None:
        """The latest clip covered ``grads``; ``nonfinite``: whether its norm was NaN/Inf."""
        self._clip = (frozenset(id(g) for g in grads), nonfinite)

    def take_clip(self, grads: list[torch.Tensor]) -> torch.Tensor | None:
        """The latest clip's non-finite flag if it covered all of ``grads``; forgotten
        either way, so a clip is never reused by a later step."""
        clip, self._clip = self._clip, None
        if clip is None or not all(id(g) in clip[0] for g in grads):
            return None
        return clip[1]

    def forget_clip(self) -> None:
        """Drop the latest clip's flag unread (a step that judges its gradients otherwise)."""
        self._clip = None

    # -- the phase recorder ---------------------------------------------------------

    def mark(self, phase: str) -> None:
        """A module acted: append ``phase`` while recording (one attribute test otherwise)."""
        if self.phases is not None:
            if phase not in PHASES:
                raise ValueError(f"unknown step phase {phase!r}; expected one of {PHASES}")
            self.phases.append(phase)

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[str]]:
        """Within the block, every phase marked is appended to the list yielded."""
        was, self.phases = self.phases, []
        try:
            yield self.phases
        finally:
            self.phases = was


# Run at every SafeGradScaler ``update()``, stepped or skipped (a skipped step runs no
# optimizer hook): nan_guard's step boundary. Wiring, not run state: registered at enable.
_listeners: list[Callable[[], None]] = []


def on_iteration_end(callback: Callable[[], None]) -> None:
    """Call ``callback()`` at every SafeGradScaler ``update()`` (once per registration)."""
    if callback not in _listeners:
        _listeners.append(callback)


def context() -> StepContext:
    """The current run's step context."""
    return _runstate.current().part(StepContext)


# -- the pipeline ----------------------------------------------------------------------

@dataclasses.dataclass(eq=False)
class Step:
    """One optimizer's step as its stages hand it on (one per optimizer, kept weakly)."""

    # this step skipped? the guard's decision (a bool, or a fused step's device flag never
    # read here), else the found_inf a GradScaler hands a fused step, else None (taken)
    decision: bool | torch.Tensor | None = None
    # the guard's latest decision, until the LR scheduler's hold reads it
    for_scheduler: bool | torch.Tensor | None = None
    held: set[int] = dataclasses.field(default_factory=set)  # freezes that held its rows
    swaps: list[Any] = dataclasses.field(default_factory=list)  # the freeze's row views


@dataclasses.dataclass
class Stages:
    """The stages the applied patches fill in, in the order they run (what each does: the
    table of docs/design/step.md); None: that patch is off. Set with :func:`set_stage`; run
    only by :func:`before_step` and :func:`after_step`."""

    check_resume: Callable[[Any], None] | None = None  # resume_check
    find_frozen: Callable[[Any], None] | None = None  # vocab_freeze (BASE_VOCAB)
    prepare_frozen: Callable[[Any, Step], None] | None = None  # vocab_freeze
    # nan_guard; returns the (args, kwargs) to step with, or None: unchanged
    decide: Callable[[Any, tuple[Any, ...], dict[str, Any], Step], Any] | None = None
    hold_frozen: Callable[[Any, tuple[Any, ...], dict[str, Any], Step], None] | None = None
    keep_frozen: Callable[[Any, Step], None] | None = None  # vocab_freeze, as hold_frozen
    record: Callable[[Any, dict[str, Any], Step], None] | None = None  # nan_guard


STAGES = Stages()
_steps: weakref.WeakKeyDictionary[Any, Step] = weakref.WeakKeyDictionary()
_hooks: list[Any] = []


def step_of(optimizer: Any) -> Step:
    """``optimizer``'s :class:`Step`, made at its first step."""
    step = _steps.get(optimizer)
    if step is None:
        step = _steps[optimizer] = Step()
    return step


def before_step(optimizer: Any, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The library's one global optimizer pre-hook: the stages before torch's update."""
    step = step_of(optimizer)
    stages = STAGES
    if stages.check_resume is not None:
        stages.check_resume(optimizer)  # sees the optimizer as the resume left it
    if stages.find_frozen is not None:
        stages.find_frozen(optimizer)  # BASE_VOCAB: freeze the models this optimizer trains
    if stages.prepare_frozen is not None:
        stages.prepare_frozen(optimizer, step)
    changed = None
    step.decision = None
    if stages.decide is not None:
        changed = stages.decide(optimizer, args, kwargs, step)  # on the whole gradients
        if changed is not None:
            args, kwargs = changed
    if step.decision is None:
        step.decision = getattr(optimizer, "found_inf", None)  # a GradScaler's fused step
    if stages.hold_frozen is not None:
        stages.hold_frozen(optimizer, args, kwargs, step)  # after the decision: it skips
    # torch now updates the parameters; a skip left every gradient None (a no-op update);
    # a fused step's device flag is read by the kernel: "step" either way on the host
    context().mark("skip" if step.decision is True else "step")
    return changed


def after_step(optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """The library's one global optimizer post-hook: the stages after torch's update."""
    step = step_of(optimizer)
    stages = STAGES
    if stages.keep_frozen is not None:
        stages.keep_frozen(optimizer, step)  # counts toward until_step only a taken step
    if stages.record is not None:
        stages.record(optimizer, kwargs, step)
    step.decision = None


def set_stage(name: str, function: Callable[..., Any] | None) -> None:
    """Fill in (or, with None, clear) one stage; the pipeline's two global hooks are
    registered with the first stage and removed when every stage is clear again."""
    if not hasattr(STAGES, name):
        raise ValueError(f"unknown step stage {name!r}; expected one of "
                         f"{[f.name for f in dataclasses.fields(Stages)]}")
    setattr(STAGES, name, function)
    active = any(getattr(STAGES, f.name) is not None for f in dataclasses.fields(Stages))
    if active and not _hooks:
        _hooks.append(register_optimizer_step_pre_hook(before_step))
        _hooks.append(register_optimizer_step_post_hook(after_step))
    elif not active:
        while _hooks:
            _hooks.pop().remove()


def take_scheduler_decision(optimizer: Any) -> bool | torch.Tensor | None:
    """The guard's latest decision on ``optimizer``'s step, once (the LR scheduler's hold);
    None for anything the guard never saw step (None, an object no weak reference takes)."""
    try:
        step = _steps.get(optimizer)
    except TypeError:  # no weak reference to it, so no step of it is known
        return None
    if step is None:
        return None
    decision, step.for_scheduler = step.for_scheduler, None
    return decision


def pipeline_on() -> bool:
    """Whether the pipeline's hooks run (they mark "step" and "skip" of every step)."""
    return bool(_hooks)


def forget_decisions() -> None:
    """No step's decision carries over (a new run in the same process). The freeze's row
    views stay known: a step that raised left them in its optimizer's groups."""
    for step in list(_steps.values()):
        step.decision = step.for_scheduler = None


_runstate.on_end(lambda run: forget_decisions())
