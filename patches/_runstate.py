"""The run object: everything the patches keep about one training run in this process.

One :class:`Run` is current at a time (:func:`current`): ``apply()`` starts a new one when
the last has ended, ``revert()`` of every patch ends it (:func:`end`; its counters stay
readable until the next). It holds the options, the output folders, the batch and step in
hand, and one *part* per module that keeps state between steps (:meth:`Run.part`).

Design: docs/design/run.md.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, TypeVar

T = TypeVar("T")

_lock = threading.RLock()


class Run:
    """One training run's state. Modules keep theirs in a part (:meth:`part`)."""

    def __init__(self, number: int) -> None:
        self.number = number  # 1 for the process's first run
        self.ended = False
        self.options: Any = None  # the options of the apply() that runs it (None: the env's)
        self.output_dir: str | None = None  # set_output_dir()
        self.trainer_dir: str | None = None  # the folder an integration reported
        self.checkpoint_dir: str | None = None  # the folder of the latest checkpoint seen
        self.batch_ids: list[str] = []  # the sample identifiers of the batch in hand
        self.trainer_step: int | None = None  # the trainer's own step count, when known
        self._parts: dict[type, Any] = {}
        self._said: set[str] = set()

    def part(self, kind: type[T]) -> T:
        """This run's instance of ``kind`` (made with ``kind()`` at the first call)."""
        try:
            return self._parts[kind]
        except KeyError:
            with _lock:
                return self._parts.setdefault(kind, kind())

    def existing(self, kind: type[T]) -> T | None:
        """This run's ``kind`` if a call of :meth:`part` made it, else None."""
        return self._parts.get(kind)

    def renew(self, kind: type[T]) -> T:
        """A fresh ``kind`` in place of this run's (a module's own reset)."""
        with _lock:
            self._parts[kind] = fresh = kind()
        return fresh

    def first_time(self, key: str) -> bool:
        """True once per run for ``key`` (a message said once per run)."""
        with _lock:
            if key in self._said:
                return False
            self._said.add(key)
            return True


_current = Run(1)
# Called with the ending run by end(): the evidence writer flushes what still waits.
_on_end: list[Callable[[Run], None]] = []


def current() -> Run:
    """The current run (the ended one until the next :func:`start`)."""
    return _current


def start() -> Run:
    """Make a new run current if the current one has ended; return the current run (cheap
    when it has not: the coqui integration calls it at every step)."""
    global _current
    if not _current.ended:
        return _current
    with _lock:
        if _current.ended:
            _current = Run(_current.number + 1)
        return _current


def end() -> None:
    """End the current run (``revert()`` of every patch): what waits to be written is
    tried once more; its counters stay readable until :func:`start`."""
    with _lock:
        run = _current
        if run.ended:
            return
        run.ended = True
    for callback in _on_end:
        callback(run)


def restart() -> Run:
    """End the current run and start a new one (``patches.advanced.reset_runtime_state``)."""
    end()
    return start()


def on_end(callback: Callable[[Run], None]) -> None:
    """Call ``callback(run)`` when a run ends (registered once, at import)."""
    if callback not in _on_end:
        _on_end.append(callback)


__all__ = ["Run", "current", "start", "end", "restart", "on_end"]
