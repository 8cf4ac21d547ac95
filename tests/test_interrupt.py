"""The first signal during a step waits for the step's end; a second one stops it at once,
unless it is the same signal again within REPEAT_WINDOW (one request delivered twice: a dying
parent's death signal per thread, a launcher forwarding what the group also got)."""

from __future__ import annotations

import signal

import forkserver
import pytest

from patches import _interrupt, _run
from patches._interrupt import Interruption, TrainingInterrupted
from processes import child_path


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


def test_no_signal_cuts_the_handling_of_an_interruption_short(monkeypatch) -> None:
    """The checkpoint, the callbacks and the record of an interruption are written whatever
    comes next: the same signal again (even after the window) or another one."""
    clock = iter(range(100))
    monkeypatch.setattr(_interrupt.time, "monotonic",
                        lambda: next(clock) * (_interrupt.REPEAT_WINDOW + 1))
    interruption = Interruption()
    with pytest.raises(TrainingInterrupted):
        interruption._on_signal(signal.SIGTERM, None)
    done = []
    with interruption.handling():
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGTERM):
            interruption._on_signal(signum, None)  # would raise outside handling()
        done.append("record written")
    assert done == ["record written"] and interruption.absorbed == 3
    assert interruption.signum == signal.SIGTERM  # the exit code stays the first signal's


def test_the_same_signal_again_at_once_outside_a_step_is_one_request(monkeypatch) -> None:
    """Between the first signal's exception and its handling (the trainer unwinding), the
    same request delivered again does not raise a second time."""
    clock = iter(range(100))
    monkeypatch.setattr(_interrupt.time, "monotonic", lambda: next(clock) * 0.1)
    interruption = Interruption()
    with pytest.raises(TrainingInterrupted):
        interruption._on_signal(signal.SIGHUP, None)
    interruption._on_signal(signal.SIGHUP, None)
    assert interruption.absorbed == 1


def _trainer_runs(folder) -> list[dict]:
    import json

    path = folder / "trainer_runs.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.mark.xtts
@pytest.mark.slow
def test_a_coqui_trainer_stopped_by_a_signal_is_recorded_and_reported_interrupted(
        tiny_xtts, tmp_path) -> None:
    """Any coqui Trainer, not only headlessXttsTrain.py: SIGTERM after step 2 ends the run
    with 143 and a checkpoint; the signals that come while that is written (the same one
    again, Ctrl-C) do not cut it short; the run folder's trainer_runs.jsonl says start,
    interrupted; ``report`` calls the run interrupted. A run that ends says finished."""
    import os
    import sys
    from pathlib import Path

    from trainer import Trainer, TrainerArgs

    import patches

    patches.advanced.apply()

    def trainer_for(config, **callbacks):
        return Trainer(TrainerArgs(), config, config.output_path,
                       model=tiny_xtts.make_model(config),
                       train_samples=tiny_xtts.samples(config), eval_samples=None,
                       parse_command_line_args=False, callbacks=callbacks)

    whole = trainer_for(tiny_xtts.make_config(tmp_path / "whole", epochs=1))
    whole.fit()
    assert [r["event"] for r in _trainer_runs(Path(whole.output_path))] == ["start", "finished"]

    done: list[str] = []

    def step_end(trainer) -> None:
        if trainer.total_steps_done == 2 and not done:
            done.append("SIGTERM sent")
            os.kill(os.getpid(), signal.SIGTERM)

    def on_interrupt(trainer) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # the machine says it again
        os.kill(os.getpid(), signal.SIGINT)  # and someone presses Ctrl-C
        done.append("callbacks ended")

    config = tiny_xtts.make_config(tmp_path / "runs", epochs=20)
    stopped = trainer_for(config, on_train_step_end=step_end,
                          on_keyboard_interrupt=on_interrupt)
    with pytest.raises(SystemExit) as stop:
        stopped.fit()
    assert stop.value.code == 143
    assert done == ["SIGTERM sent", "callbacks ended"]
    folder = Path(stopped.output_path)
    records = _trainer_runs(folder)
    assert [r["event"] for r in records] == ["start", "interrupted"]
    last = records[-1]
    assert last["signal"] == "SIGTERM" and last["step"] == stopped.total_steps_done
    assert Path(last["checkpoint"]).is_file()
    report = forkserver.run([sys.executable, "-m", "patches", "report", str(tmp_path / "runs"),
                             "--no-picture"], capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=child_path(Path(__file__).parents[1])))
    assert "verdict: interrupted" in report.stdout, report.stdout + report.stderr
    assert f"stopped by SIGTERM at trainer step {last['step']}" in report.stdout
    # the way this trainer continues (not headlessXttsTrain.py's --resume auto)
    assert f"continue it with continue_path={folder}" in report.stdout, report.stdout
    assert "--resume auto" not in report.stdout
    assert "(trainer_runs.jsonl)" in report.stdout


def _thread_raising(error: type, filename: str) -> None:
    """A thread whose failing frame is in ``filename`` (as multiprocessing's resource-sharer
    thread's is when the process reading a batch goes away mid-hand-shake)."""
    import threading

    code = compile(f"def serve():\n    raise {error.__name__}(104, 'Connection reset by peer')\n",
                   filename, "exec")
    space: dict = {}
    exec(code, space)
    thread = threading.Thread(target=space["serve"], name="Thread-9 (_serve)")
    thread.start()
    thread.join()


def test_a_batch_handoff_cut_by_the_interruption_prints_no_traceback(monkeypatch) -> None:
    """While an interruption is installed, the resource sharer's ConnectionResetError (a
    DataLoader worker whose reader stopped) is left out; another error of that thread, and
    the same error from anywhere else, reach the hook that was there (which prints them);
    once uninstalled, that hook is back."""
    import os
    import threading

    reached: list[str] = []
    monkeypatch.setattr(threading, "excepthook",
                        lambda args: reached.append(args.exc_type.__name__))
    before = threading.excepthook
    sharer = os.path.join(os.path.dirname(threading.__file__), "multiprocessing",
                          "resource_sharer.py")
    with Interruption().installed():
        _thread_raising(ConnectionResetError, sharer)
        assert reached == []
        _thread_raising(ConnectionResetError, "/somewhere/else.py")
        _thread_raising(PermissionError, sharer)
        assert reached == ["ConnectionResetError", "PermissionError"]
    assert threading.excepthook is before
    _thread_raising(ConnectionResetError, sharer)  # not installed: as upstream
    assert reached[-1] == "ConnectionResetError" and len(reached) == 3
