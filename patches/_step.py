"""One optimizer step as grad_scaler, grad_clip and nan_guard share it: :data:`CONTEXT`.

Within a step the phases run in the order of :data:`PHASES`: ``backward`` (the loss's
backward returned), ``unscale`` (a SafeGradScaler has the overflow flag), ``clip``
(``clip_grad_norm_`` leaves its non-finite flag here), ``decide`` (the scaler's or the
guard's flag is read), ``step`` or ``skip``, ``record`` (counters, scale, the
iteration-end listeners). A scaler that was not asked to unscale does so inside its own
step, after the clip. ``step(closure)``: the guard's pre-hook runs the closure (forward,
backward, clip) and decides after it. Each module writes its part into the one
:class:`StepContext` and reads the others' from there, never their private attributes;
:meth:`StepContext.recording` lists the phases as they run (off by default).

Design: docs/design/step.md
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Callable, Iterator

import torch

PHASES = ("backward", "unscale", "clip", "decide", "step", "skip", "record")


class StepContext:
    """What the patches tell each other within one optimizer step (one per process).

    Thread-safety is the modules' own of before: the scaler's ``stepping`` flag is per
    thread (the optimizer step it covers runs in one); the rest is process-wide, as a
    training step is driven from one thread.
    """

    def __init__(self) -> None:
        # grad_scaler writes, grad_clip and nan_guard read: the SafeGradScaler whose scale()
        # ran last and whose update() has not yet (weak: a dropped scaler is no longer pending)
        self._scaler: weakref.ref[Any] | None = None
        self._local = threading.local()  # .stepping: inside the scaler's optimizer.step()
        # grad_scaler runs them at each update(), stepped or skipped (a skipped step runs
        # no optimizer hook); nan_guard registers its step boundary
        self._listeners: list[Callable[[], None]] = []
        # grad_clip writes, nan_guard takes (once): the latest clip's gradient ids and its
        # non-finite flag on the device, so one reduction serves the clip and the guard
        self._clip: tuple[frozenset[int], torch.Tensor] | None = None
        # nan_guard writes, vocab_freeze takes: id(optimizer) -> this step skipped?
        self._decisions: dict[int, bool | torch.Tensor] = {}
        # The phases as they run, while recording(); None (the default) records nothing.
        self.phases: list[str] | None = None

    # -- the scaler (written by grad_scaler) ---------------------------------------

    def scaler_scaled(self, scaler: Any) -> None:
        """``scaler`` scaled a loss: it is pending until its ``update()``."""
        self._scaler = weakref.ref(scaler)

    def scaler_updated(self, scaler: Any) -> None:
        """``scaler.update()`` ran: it is no longer pending, and the iteration ends."""
        if self._scaler is not None and self._scaler() is scaler:
            self._scaler = None
        for listener in self._listeners:
            listener()

    def pending_scaler(self) -> Any | None:
        """The SafeGradScaler that scaled a loss this iteration and has not updated yet."""
        return self._scaler() if self._scaler is not None else None

    @property
    def scaler_stepping(self) -> bool:
        """True inside an ``optimizer.step()`` a SafeGradScaler runs after its own finite
        check: the step is protected, the guard adds no second check."""
        return getattr(self._local, "stepping", False)

    @scaler_stepping.setter
    def scaler_stepping(self, value: bool) -> None:
        self._local.stepping = value

    def on_iteration_end(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` at every SafeGradScaler ``update()`` (once per registration)."""
        if callback not in self._listeners:
            self._listeners.append(callback)

    def forget_scaler(self) -> None:
        """No scaler pending, none stepping (a new run; the listeners stay registered)."""
        self._scaler = None
        self._local.stepping = False

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

    # -- the decision (written by nan_guard, taken by vocab_freeze) -----------------

    def put_decision(self, optimizer: Any, skipped: bool | torch.Tensor) -> None:
        """The guard decided ``optimizer``'s step: skipped (a bool, or a fused step's
        device flag, never read here)."""
        self._decisions[id(optimizer)] = skipped

    def forget_decision(self, optimizer: Any) -> None:
        """The step is over: its decision is not the next step's."""
        self._decisions.pop(id(optimizer), None)

    def take_decision(self, optimizer: Any) -> bool | torch.Tensor | None:
        """Whether this step of ``optimizer`` is skipped: the guard's decision, else the
        ``found_inf`` a GradScaler hands a fused step (an attribute of the optimizer, a
        device flag), else None (no one decided: the step is taken)."""
        decision = self._decisions.pop(id(optimizer), None)
        if decision is None:
            decision = getattr(optimizer, "found_inf", None)
        return decision

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


CONTEXT = StepContext()
