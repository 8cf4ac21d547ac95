"""``training-patches report`` on the runs of the trainers that keep their own logs (issue
38, item 5): the HF Trainer's ``trainer_state.json`` and TensorBoard tags, Lightning's
``metrics.csv``; and how a run ended, from ``trainer_runs.jsonl``: a start with no end whose
process is gone is interrupted, one whose process runs is running, one on another machine
cannot be checked, an error is a finding. (The real trainers, killed: the
``test_a_run_*_sigterm_*`` tests of test_transformers_trainer.py and test_lightning.py.)"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from patches.tools import cli
from patches.tools.report import build, find_runs


def _jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def _hf_state(folder: Path, steps: int, max_steps: int = 8) -> None:
    """An HF checkpoint folder's trainer_state.json, a loss logged at each step."""
    folder.mkdir(parents=True)
    history = [{"loss": 4.0 - 0.1 * s, "grad_norm": 1.0 + s, "learning_rate": 1e-3, "epoch": 0.1,
                "step": s} for s in range(1, steps + 1)]
    (folder / "trainer_state.json").write_text(json.dumps(
        {"global_step": steps, "max_steps": max_steps, "log_history": history}))


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _text(folder: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli.main(["report", str(folder), "--no-picture"])
    return code, capsys.readouterr().out


def _start(folder: Path, pid: int, host: str | None = None) -> dict[str, Any]:
    return {"event": "start", "run_folder": str(folder), "pid": pid,
            "host": host or socket.gethostname(), "step": 0, "trainer": "transformers_trainer",
            "continue_with": "trainer.train(resume_from_checkpoint=True)"}


def test_an_hf_output_dir_is_a_run_and_its_logged_losses_are_read(tmp_path, capsys) -> None:
    """Only checkpoint-N/ folders (no record of the patches): a run, its losses, learning
    rate and gradient norm read from the newest trainer_state.json."""
    out = tmp_path / "out"
    _hf_state(out / "checkpoint-2", 2)
    _hf_state(out / "checkpoint-4", 4)
    (run,) = find_runs(str(out))
    assert run.folder == str(out)
    facts = build(run).facts
    assert facts.losses["loss"] == [(s, pytest.approx(4.0 - 0.1 * s)) for s in range(1, 5)]
    assert facts.loss_source == str(out / "checkpoint-4" / "trainer_state.json")
    assert [s for s, _ in facts.lr] == [1, 2, 3, 4] and facts.grad_norm[-1] == (4, 5.0)
    code, text = _text(out, capsys)
    assert "loss 3.9 at step 1 -> 3.6 at step 4 (4 logged, from " in text
    # nothing says how it ended, and it is short of max_steps: not called healthy
    assert code == 1 and "whether the run ended" in text and "step 4 of max_steps 8" in text


def test_an_hf_run_at_its_max_steps_with_no_record_is_healthy(tmp_path, capsys) -> None:
    out = tmp_path / "out"
    _hf_state(out / "checkpoint-8", 8)
    assert _text(out, capsys)[0] == 0


def test_the_hf_trainers_tensorboard_tags_are_read(tmp_path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    folder = tmp_path / "out" / "runs" / "May01_10-00-00_host"
    writer = SummaryWriter(str(folder))
    for step in range(1, 6):
        writer.add_scalar("train/loss", 3.0 - 0.2 * step, step)
        writer.add_scalar("train/learning_rate", 1e-4, step)
    writer.close()
    facts = build(find_runs(str(tmp_path / "out"))[0]).facts
    assert [s for s, _ in facts.losses["loss"]] == [1, 2, 3, 4, 5]
    assert facts.loss_source == "TensorBoard" and len(facts.lr) == 5


def test_a_lightning_csv_logger_folder_is_a_run_with_its_loss(tmp_path, capsys) -> None:
    """Lightning's CSVLogger: version_0/metrics.csv (a column per logged name, empty where a
    row does not log it) is read for train_loss and LearningRateMonitor's lr-AdamW."""
    version = tmp_path / "logs" / "version_0"
    version.mkdir(parents=True)
    (version / "hparams.yaml").write_text("{}\n")
    rows = ["epoch,lr-AdamW,step,train_loss,val_loss"]
    rows += [f"0,0.01,{s},{2.0 - 0.1 * s:.2f}," for s in range(10)] + ["0,,9,,1.5"]
    (version / "metrics.csv").write_text("\n".join(rows) + "\n")
    (run,) = find_runs(str(tmp_path / "logs"))
    assert run.folder == str(version)
    facts = build(run).facts
    assert [s for s, _ in facts.losses["loss"]] == list(range(10))
    assert len(facts.lr) == 10 and facts.steps == 10
    code, text = _text(tmp_path / "logs", capsys)
    assert "(10 logged, from " in text and "metrics.csv)" in text and code == 0, text


def test_a_start_whose_process_is_gone_is_interrupted(tmp_path, capsys) -> None:
    """trainer_runs.jsonl ends on a start, and the process that wrote it is gone from this
    machine: killed outright (SIGKILL, a SIGTERM nothing handled) or died."""
    out = tmp_path / "out"
    _hf_state(out / "checkpoint-4", 4)
    pid = _dead_pid()
    _jsonl(out / "trainer_runs.jsonl", [_start(out, pid)])
    code, text = _text(out, capsys)
    assert code == 1 and "verdict: interrupted" in text, text
    assert (f"the run started at trainer step 0 (process {pid}) and recorded no end, and that "
            f"process is gone from this machine") in text
    assert ("continue it from its newest checkpoint (checkpoint-4) with "
            "trainer.train(resume_from_checkpoint=True) (trainer_runs.jsonl)") in text


def test_a_start_whose_process_runs_is_running_not_a_finding(tmp_path, capsys) -> None:
    out = tmp_path / "out"
    _hf_state(out / "checkpoint-8", 8)
    _jsonl(out / "trainer_runs.jsonl", [_start(out, os.getpid())])
    code, text = _text(out, capsys)
    assert f"running: process {os.getpid()} on this machine" in text and code == 0, text


def test_a_start_on_another_machine_is_a_check_not_run(tmp_path, capsys) -> None:
    out = tmp_path / "out"
    _hf_state(out / "checkpoint-8", 8)
    _jsonl(out / "trainer_runs.jsonl", [_start(out, 12345, host="elsewhere-node-7")])
    code, text = _text(out, capsys)
    assert code == 1 and "verdict: checks not run" in text, text
    assert "it recorded its start on elsewhere-node-7 (process 12345" in text


def test_an_error_that_stopped_the_run_is_a_finding(tmp_path, capsys) -> None:
    out = tmp_path / "out"
    _hf_state(out / "checkpoint-2", 2)
    _jsonl(out / "trainer_runs.jsonl", [
        _start(out, _dead_pid()),
        {"event": "failed", "run_folder": str(out), "step": 3, "error": "ValueError: bad batch"}])
    code, text = _text(out, capsys)
    assert code == 1 and "verdict: stopped by an error" in text, text
    assert "stopped at trainer step 3 by ValueError: bad batch, and not continued since" in text


def test_a_record_of_the_folder_above_a_tensorboard_folder_counts(tmp_path, capsys) -> None:
    """The HF Trainer's TensorBoard folder is below its output_dir, where trainer_runs.jsonl
    is: the run's interruption is read from there."""
    from torch.utils.tensorboard import SummaryWriter

    out = tmp_path / "out"
    writer = SummaryWriter(str(out / "runs" / "May01"))
    writer.add_scalar("train/loss", 1.0, 1)
    writer.close()
    _jsonl(out / "trainer_runs.jsonl", [
        _start(out, _dead_pid()),
        {"event": "interrupted", "run_folder": str(out), "step": 5, "signal": "SIGINT",
         "checkpoint": str(out / "checkpoint-4"),
         "continue_with": "trainer.train(resume_from_checkpoint=True)"}])
    code, text = _text(out, capsys)
    assert code == 1 and ("interrupted: stopped by SIGINT at trainer step 5 and not continued "
                          "since; its newest checkpoint is checkpoint-4: continue it with "
                          "trainer.train(resume_from_checkpoint=True)") in text, text


def test_a_finished_run_short_of_its_max_steps_is_healthy(tmp_path, capsys) -> None:
    """A run that recorded its end (stopped early on purpose, by a callback) is not a run
    whose end is unknown."""
    out = tmp_path / "out"
    _hf_state(out / "checkpoint-4", 4)
    _jsonl(out / "trainer_runs.jsonl", [_start(out, _dead_pid()),
                                        {"event": "finished", "run_folder": str(out), "step": 4}])
    code, text = _text(out, capsys)
    assert code == 0 and "verdict: healthy" in text, text
