"""Issue 27: the data position covers the coqui Trainer's loader. A real coqui Trainer
training the tiny XTTS GPTTrainer saves checkpoints mid-epoch; ``continue_path`` from one
of them trains on exactly the batches the uninterrupted run trained on after it, where
upstream starts the epoch again from a new order (the control)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import patches

pytestmark = [pytest.mark.xtts, pytest.mark.slow]

torch.set_num_threads(1)


def _recording(trainer) -> list[list[str]]:
    """The sample files of every batch the model trains on, in order."""
    seen: list[list[str]] = []
    model = trainer.model
    original = model.train_step

    def train_step(batch, criterion):
        seen.append([Path(f).name for f in batch["filenames"]])
        return original(batch, criterion)

    model.train_step = train_step
    return seen


def _run(tiny_xtts, folder: Path, **kwargs):
    config = tiny_xtts.make_config(folder, epochs=2, save_step=3, save_n_checkpoints=100)
    trainer = tiny_xtts.make_trainer(config, **kwargs)
    seen = _recording(trainer)
    trainer.fit()
    return trainer, seen


@pytest.fixture(scope="module")
def uninterrupted_run(tiny_xtts, tmp_path_factory) -> tuple[Path, list[list[str]]]:
    """One patched run to its end (a checkpoint every 3 steps) and the batches it trained
    on: the same for both cases below, so trained once. It is the uninterrupted run, and
    each case makes the killed one from a copy of its folder (before: two identical runs
    per case, one for each role)."""
    patches.advanced.apply()
    try:
        trainer, full = _run(tiny_xtts, tmp_path_factory.mktemp("uninterrupted") / "run")
        run = Path(trainer.output_path)
    finally:
        patches.revert()  # the run ends here; each case continues it as a new run
    return run, full


@pytest.mark.parametrize("applied", [True, False], ids=["patched", "upstream"])
def test_continue_path_trains_on_the_batches_the_uninterrupted_run_trained_on(
        tiny_xtts, uninterrupted_run, tmp_path, applied):
    patches.advanced.apply()
    finished, full = uninterrupted_run
    # coqui continues inside the folder it is given: a copy of its own for each case, as a
    # kill after the save of step 3 leaves it: only checkpoint_3.pth
    run = tmp_path / finished.name
    shutil.copytree(finished, run, ignore=lambda folder, names: [
        name for name in names if name.endswith(".pth") and name != "checkpoint_3.pth"])
    assert [p.name for p in run.glob("*.pth")] == ["checkpoint_3.pth"]
    assert len(full) >= 10 and len(full[0]) == 2  # 2 epochs of 13 clips in batches of 2
    if not applied:
        patches.revert("checkpoint")
    config = tiny_xtts.make_config(tmp_path / "unused", epochs=2)
    resumed = tiny_xtts.make_trainer(config, continue_path=str(run))
    seen = _recording(resumed)
    resumed.fit()
    per_epoch = len(full) // 2
    if applied:
        # the step of checkpoint_3 was the 4th batch: training continues at the 5th
        assert seen == full[4:]
    else:
        # upstream: epoch 0 again from its beginning, in another order
        assert len(seen) == len(full) and seen[:per_epoch] != full[4:4 + per_epoch]


def _losses(trainer) -> list[tuple[list[str], float]]:
    """Each trained batch's sample files and its loss, in order."""
    seen: list[tuple[list[str], float]] = []
    model = trainer.model
    original = model.train_step

    def train_step(batch, criterion):
        outputs, losses = original(batch, criterion)
        seen.append(([Path(f).name for f in batch["filenames"]], float(losses["loss"].detach())))
        return outputs, losses

    model.train_step = train_step
    return seen


@pytest.mark.parametrize("where", ["between_steps", "during_a_step"])
def test_a_run_stopped_by_sigterm_continues_as_if_never_stopped(
        tiny_xtts, tmp_path, monkeypatch, caplog, where):
    """The checkpoint written on SIGTERM continues exactly: the same batches with the same
    losses and the same step count as the uninterrupted run, and the same final weights. The
    signal comes while a batch is read (its samples drew from ``random`` already) or during
    a training step; either way the checkpoint holds the state after the last finished step.
    (Before: the continued run counted one step too many, and after a signal during reading
    the samples drew other random crops.)"""
    import os
    import signal

    from TTS.tts.layers.xtts.trainer.dataset import XTTSDataset

    patches.advanced.apply()

    def run(folder: Path, **kwargs):
        config = tiny_xtts.make_config(folder, epochs=2, save_step=10 ** 6)
        torch.manual_seed(0)  # the same new model each time
        trainer = tiny_xtts.make_trainer(config, **kwargs)
        return trainer, _losses(trainer)

    full, full_seen = run(tmp_path / "full")
    full.fit()
    total = full.total_steps_done

    reads = {"n": 0}
    original_load = XTTSDataset.load_item

    def load_item(self, sample):
        reads["n"] += 1
        if where == "between_steps" and reads["n"] == 2 * 3 + 1:  # reading the 4th batch
            os.kill(os.getpid(), signal.SIGTERM)
        return original_load(self, sample)

    monkeypatch.setattr(XTTSDataset, "load_item", load_item)
    stopped, stopped_seen = run(tmp_path / "stopped")
    if where == "during_a_step":
        model_step = stopped.model.train_step

        def step_then_signal(batch, criterion):
            if len(stopped_seen) == 3:
                os.kill(os.getpid(), signal.SIGTERM)  # lands during the 4th step
            return model_step(batch, criterion)

        stopped.model.train_step = step_then_signal
    with pytest.raises(SystemExit) as stop:
        stopped.fit()
    assert stop.value.code == 143
    monkeypatch.setattr(XTTSDataset, "load_item", original_load)
    done = len(stopped_seen)
    assert done == (3 if where == "between_steps" else 4)
    assert stopped_seen == full_seen[:done]

    config = tiny_xtts.make_config(tmp_path / "unused", epochs=2, save_step=10 ** 6)
    with caplog.at_level("INFO", logger="training_patches"):
        resumed = tiny_xtts.make_trainer(config, continue_path=str(stopped.output_path))
    resumed_seen = _losses(resumed)
    resumed.fit()
    assert f"the run continues at trainer step {done}" in caplog.text
    assert resumed_seen == full_seen[done:]
    assert resumed.total_steps_done == total
    for name, value in full.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[name]), name
