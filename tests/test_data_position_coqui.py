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


@pytest.mark.parametrize("applied", [True, False], ids=["patched", "upstream"])
def test_continue_path_trains_on_the_batches_the_uninterrupted_run_trained_on(
        tiny_xtts, tmp_path, clean_patches, applied):
    patches.apply()
    _, full = _run(tiny_xtts, tmp_path / "full")
    trainer, _ = _run(tiny_xtts, tmp_path / "stopped")
    run = Path(trainer.output_path)
    # the run as a kill after the save of step 3 leaves it: only checkpoint_3.pth
    for later in run.glob("*.pth"):
        if later.name != "checkpoint_3.pth":
            later.unlink()
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
