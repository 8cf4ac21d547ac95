"""The coqui Trainer stopped by a signal (the ``checkpoint`` patch, declared by
:mod:`.coqui_trainer`): SIGTERM and SIGHUP interrupt a run as Ctrl-C does
(:mod:`patches._interrupt`), where upstream (coqui-tts-trainer 0.4) dies unsaved on them and
ends Ctrl-C with ``os._exit(130)``: a step ends before the signal is raised, ``Trainer._fit``
handles it (:func:`on_interrupt`) and the run exits ``128 + signal``. The user's view:
TRAINING_PATCHES_README.md, "With the coqui Trainer / XTTS".
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator

from .. import _run, nan_guard
from . import coqui_checkpoint, xtts_gpt
from .._interrupt import Interruption, TrainingInterrupted
from .._log import logger


# Per Trainer: its interruption, the step its fit() started at, the step of its last save.
_interruptions: "weakref.WeakKeyDictionary[Any, Interruption]" = weakref.WeakKeyDictionary()
_started_at: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
_saved_at: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
# Per Trainer: the state when its last step ended; the interruption's save while it runs.
_after_step: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
_between_steps: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def _steps(trainer: Any) -> int:
    return int(getattr(trainer, "total_steps_done", 0) or 0)


@contextlib.contextmanager
def interruptible_run(trainer: Any) -> Iterator[None]:
    """``Trainer.fit``'s run, interrupted by SIGINT, SIGTERM and SIGHUP: it exits ``128 +
    signal`` once ``Trainer._fit`` has handled one, else it is recorded as finished."""
    interruption = _interruptions[trainer] = Interruption()
    _started_at[trainer] = _steps(trainer)
    base = xtts_gpt.base_load(getattr(trainer, "model", None))
    _record(trainer, "start", **({"base_weights": base.as_record()} if base is not None else {}))
    with interruption.installed():
        yield
    if interruption.signum is not None:
        raise SystemExit(128 + interruption.signum)
    nan_guard.settle()  # the last fused steps' skips, recorded before the run says it ended
    _record(trainer, "finished")


@contextlib.contextmanager
def uninterrupted(trainer: Any, *, keep_step: bool = False) -> Iterator[None]:
    """What runs inside (a ``train_step``, a ``save_best_model``) is interrupted by a signal
    only once it has ended. ``keep_step``: what a checkpoint written on that interruption
    needs of the moment the step ended is kept (:func:`.coqui_checkpoint.after_step`)."""
    interruption = _interruptions.get(trainer)
    if interruption is None:
        yield
        return
    with interruption.step():
        yield
        if keep_step:
            _after_step[trainer] = coqui_checkpoint.after_step(trainer)


def make_uninterrupted(original: Callable[..., Any]) -> Callable[..., Any]:
    """A Trainer method (``save_best_model``) run :func:`uninterrupted`."""

    @functools.wraps(original)
    def uninterrupted_method(self: Any, *args: Any, **kwargs: Any) -> Any:
        with uninterrupted(self):
            return original(self, *args, **kwargs)

    return uninterrupted_method


def make_save_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Trainer.save_checkpoint`` that first records the fused steps' waiting skips (a run
    killed after a save has every skip up to it on disk), and remembers the step it saved."""

    @functools.wraps(original)
    def save_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
        nan_guard.settle()
        with coqui_checkpoint.saving_from(self, _between_steps.get(self)):
            result = original(self, *args, **kwargs)
        _saved_at[self] = _steps(self)
        return result

    return save_checkpoint


def make_inner_fit(original: Callable[[Any], None]) -> Callable[[Any], None]:
    """``Trainer._fit`` that handles an interruption and returns, so that upstream's ``fit``
    ends normally (its KeyboardInterrupt branch would ``os._exit(130)``)."""

    @functools.wraps(original)
    def _fit(self: Any) -> None:
        try:
            original(self)
        except TrainingInterrupted as stop:
            interruption = _interruptions.get(self)
            if interruption is None:
                raise
            with interruption.handling():
                on_interrupt(self, stop)

    return _fit


def on_interrupt(trainer: Any, stop: TrainingInterrupted) -> None:
    """Save (when a step finished since the last checkpoint), call the trainer's
    ``on_keyboard_interrupt`` callbacks, say it in one line."""
    steps = _steps(trainer)
    folder = Path(getattr(trainer, "output_path", "."))
    # a periodic save runs inside the step, before upstream counts it
    last = _saved_at.get(trainer)
    done = max(_started_at.get(trainer, 0), last + 1 if last is not None else 0)
    wanted = bool(getattr(getattr(trainer, "config", None), "save_on_interrupt", True))
    if stop.mid_step:
        saved = ("no checkpoint written: a second signal stopped a step half-way, so its "
                 "weights may be half-updated; the last checkpoint in that folder is the one "
                 "to continue from")
    elif steps <= done:
        saved = ("no step finished since the last checkpoint, so none was written; continue "
                 "from that run folder")
    elif not wanted:
        saved = "no checkpoint written (save_on_interrupt is off)"
    else:
        # the state after the last finished step, counted as coqui counts its own saves
        _between_steps[trainer] = _after_step.get(trainer) or coqui_checkpoint.after_step(trainer)
        try:
            trainer.save_checkpoint()
        finally:
            _between_steps.pop(trainer, None)
        saved = (f"checkpoint_{steps}.pth written; continue from that run folder "
                 f"(continue_path)")
    checkpoint = folder / f"checkpoint_{steps}.pth"
    _record(trainer, "interrupted", signal=stop.name,
            checkpoint=str(checkpoint) if checkpoint.is_file() else None,
            continue_with=f"continue_path={folder} (the trainer's --continue_path)")
    logger.warning("training-patches: interrupted by %s after trainer step %d in %s: %s",
                   stop.name, steps, folder, saved)
    callbacks = getattr(trainer, "callbacks", None)
    if callbacks is not None:
        callbacks.on_keyboard_interrupt(trainer)


def _record(trainer: Any, event: str, **fields: Any) -> None:
    """One line in the run folder's ``trainer_runs.jsonl`` (best effort, as every record)."""
    folder = getattr(trainer, "output_path", None)
    if folder and os.path.isdir(folder):  # the host: report tells a killed run from a live one
        _run.record_in(folder, _run.TRAINER_RUNS_FILE, event, run_folder=str(folder),
                       step=_steps(trainer), host=socket.gethostname(), **fields)


def interrupted_by(trainer: Any) -> str | None:
    """The name of the signal that interrupted ``trainer``'s run (``"SIGTERM"``), or None."""
    interruption = _interruptions.get(trainer)
    if interruption is None or interruption.signum is None:
        return None
    return TrainingInterrupted(interruption.signum).name


__all__ = ["interruptible_run", "uninterrupted", "make_inner_fit", "make_uninterrupted",
           "make_save_checkpoint", "on_interrupt", "interrupted_by"]
