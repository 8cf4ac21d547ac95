"""A signal is an interruption: SIGTERM (a scheduler stopping the job) and SIGHUP (a closed
ssh session) stop a training loop the way Ctrl-C does, the step first.

:class:`Interruption` (used by :mod:`patches.integrations.coqui_interrupt`): while
:meth:`~Interruption.installed`, each of :data:`SIGNALS` still at its default handler raises
:class:`TrainingInterrupted` (a ``KeyboardInterrupt``) in the main thread, after the step in
progress (:meth:`~Interruption.step`); the process exits ``128 + signal``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Any, Iterator

from ._log import logger

# SIGHUP does not exist on Windows.
SIGNALS: tuple[int, ...] = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


class TrainingInterrupted(KeyboardInterrupt):
    """The run was stopped by a signal. A ``KeyboardInterrupt``, so that a trainer's own
    Ctrl-C handling applies; ``exit_code`` is 128 + ``signum``; ``mid_step`` is true when a
    second signal stopped a step before it ended (its weights may be half-updated)."""

    def __init__(self, signum: int, *, mid_step: bool = False) -> None:
        self.signum = signum
        self.name = signal.Signals(signum).name
        self.exit_code = 128 + signum
        self.mid_step = mid_step
        super().__init__(f"interrupted by {self.name}")


def _is_default(signum: int, handler: Any) -> bool:
    if signum == signal.SIGINT:
        return handler is signal.default_int_handler
    return handler == signal.SIG_DFL


# The same signal again within this many seconds is the same request delivered twice by
# machinery (a parent-death signal per thread, a launcher forwarding a group's signal).
REPEAT_WINDOW = 2.0


_HANDOFF_ERRORS = (ConnectionResetError, BrokenPipeError, EOFError)
_RESOURCE_SHARER = os.path.join("multiprocessing", "resource_sharer.py")


def _broken_handoff(args: Any) -> bool:
    """An exception of multiprocessing's resource-sharer thread (which hands a tensor's file
    descriptor to the process reading a DataLoader batch) because the reader went away."""
    if not (isinstance(args.exc_type, type) and issubclass(args.exc_type, _HANDOFF_ERRORS)):
        return False
    tb = args.exc_traceback
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith(_RESOURCE_SHARER):
            return True
        tb = tb.tb_next
    return False


@contextlib.contextmanager
def _quiet_handoffs() -> Iterator[None]:
    previous = threading.excepthook

    def excepthook(args: Any) -> None:
        if _broken_handoff(args):
            logger.debug("training-patches: a DataLoader batch hand-off ended when its reader "
                         "stopped (%s in %s); nothing was lost", args.exc_type.__name__,
                         getattr(args.thread, "name", "a thread"))
            return
        previous(args)

    threading.excepthook = excepthook
    try:
        yield
    finally:
        if threading.excepthook is excepthook:
            threading.excepthook = previous


class Interruption:
    """One run's interruption: which signal came (``signum``), and whether a step is on."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.in_step = False
        self.pending = False  # a signal came during a step: raised when it ends
        self.since = 0.0  # when the first signal came
        self.in_handling = False  # the interruption is being handled: nothing cuts it short
        self.absorbed = 0  # signals that came while it was handled, or repeated the first

    def _on_signal(self, signum: int, _frame: object) -> None:
        now = time.monotonic()
        if self.in_handling or (signum == self.signum and now - self.since < REPEAT_WINDOW):
            self.absorbed += 1  # an interruption under way finishes; a repeat is one request
            return
        if self.signum is None:
            self.signum, self.since = signum, now
        if self.in_step and not self.pending:  # the first signal: let the step finish
            self.pending = True
            return
        self.pending = False
        raise TrainingInterrupted(self.signum, mid_step=self.in_step)

    @contextlib.contextmanager
    def handling(self) -> Iterator[None]:
        """While the interruption is handled (its checkpoint, callbacks, record), a further
        signal is absorbed: a save cut short would lose what the interruption is for. Not let
        go afterwards: the run is ending."""
        self.in_handling = True
        yield

    @contextlib.contextmanager
    def installed(self) -> Iterator["Interruption"]:
        """While inside, :data:`SIGNALS` with their default handler interrupt the run (the
        main thread only; elsewhere nothing is installed). The handlers are put back."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous: dict[int, Any] = {}
        for signum in SIGNALS:
            current = signal.getsignal(signum)
            if _is_default(signum, current):
                previous[signum] = signal.signal(signum, self._on_signal)
        try:
            with _quiet_handoffs():
                yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """One training step: a signal during it is raised as :class:`TrainingInterrupted`
        when it ends (a second signal raises at once)."""
        outer = self.in_step
        self.in_step = True
        try:
            yield
        finally:
            self.in_step = outer
        if self.pending and not outer:
            self.pending = False
            raise TrainingInterrupted(self.signum or signal.SIGINT)


__all__ = ["SIGNALS", "TrainingInterrupted", "Interruption"]
