"""The first signal during a step waits for the step's end; a second one stops it at once,
unless it is the same signal again within REPEAT_WINDOW (one request delivered twice: a dying
parent's death signal per thread, a launcher forwarding what the group also got)."""

from __future__ import annotations

import signal

import pytest

from patches import _interrupt
from patches._interrupt import Interruption, TrainingInterrupted


def _step_with(signals: list[int], monkeypatch, gap: float = 0.1) -> TrainingInterrupted:
    clock = iter(range(100))
    monkeypatch.setattr(_interrupt.time, "monotonic", lambda: next(clock) * gap)
    interruption = Interruption()
    with pytest.raises(TrainingInterrupted) as caught:
        with interruption.step():
            for signum in signals:
                interruption._on_signal(signum, None)
    return caught.value


def test_the_same_signal_twice_at_once_still_lets_the_step_finish(monkeypatch) -> None:
    stop = _step_with([signal.SIGTERM, signal.SIGTERM], monkeypatch)
    assert stop.name == "SIGTERM" and not stop.mid_step  # raised at the step's end


def test_another_signal_stops_the_step_at_once(monkeypatch) -> None:
    stop = _step_with([signal.SIGTERM, signal.SIGINT], monkeypatch)
    assert stop.name == "SIGTERM" and stop.mid_step


def test_the_same_signal_again_later_is_a_user_insisting(monkeypatch) -> None:
    stop = _step_with([signal.SIGINT, signal.SIGINT], monkeypatch,
                      gap=_interrupt.REPEAT_WINDOW + 0.5)
    assert stop.name == "SIGINT" and stop.mid_step
