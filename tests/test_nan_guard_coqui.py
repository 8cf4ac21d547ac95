"""nan_guard through the real coqui Trainer and a tiny XTTS GPTTrainer (fp32)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import patches
from patches import nan_guard

pytestmark = pytest.mark.xtts


def poison_batch(model, at_call: int) -> list[int]:
    """Make the text embedding output NaN for the ``at_call``-th batch (and for that same
    batch when it is replayed), as a bad sample would. Returns the call counter."""
    calls, state = [0], {"poisoned": None, "active": False}
    original = model.train_step

    def train_step(batch, *args, **kwargs):
        calls[0] += 1
        if calls[0] == at_call:
            state["poisoned"] = id(batch)
        state["active"] = id(batch) == state["poisoned"]
        return original(batch, *args, **kwargs)

    def hook(module, inputs, output):
        return output * float("nan") if state["active"] else output
    model.train_step = train_step
    model.xtts.gpt.text_embedding.register_forward_hook(hook)
    return calls


def test_one_nan_loss_is_skipped_and_recorded(tiny_xtts, tmp_path) -> None:
    nan_guard.reset()
    patches.advanced.apply()
    config = tiny_xtts.make_config(tmp_path / "run", epochs=2, plot_step=1)
    model = tiny_xtts.make_model(config)
    calls = poison_batch(model, 3)
    trainer = tiny_xtts.train(config, model)
    batches = calls[0] - 1  # the first bad batch is replayed once to find its source

    assert batches == 14  # 2 epochs of 7 batches: training went on after the bad batch
    params = list(model.parameters())
    assert sum(not bool(torch.isfinite(p).all()) for p in params) == 0
    stats = patches.stats()["nan_guard"]
    assert stats["skipped"] == 1 and stats["nonfinite_losses"] == 1
    assert stats["steps"] == batches

    events_file = os.path.join(trainer.output_path, "nonfinite_events.jsonl")
    with open(events_file) as handle:
        events = [json.loads(line) for line in handle]
    assert len(events) == 1
    event = events[0]
    assert event["kind"] == "nonfinite_loss" and event["step"] == 3
    assert len(event["samples"]) == config.batch_size
    assert all(path.endswith(".wav") and os.path.exists(path) for path in event["samples"])
    assert event["source"]["module"] == "xtts.gpt.text_embedding"  # where it started
    assert event["source"]["where"] == "output"

    # the counters reach the Trainer's dashboard (TensorBoard) every plot_step
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    board = EventAccumulator(str(trainer.output_path))
    board.Reload()
    skipped = board.Scalars("TrainingPatches/nan_guard_skipped")
    assert skipped[0].value == 0 and skipped[-1].value == 1
    nan_guard.reset()


def test_without_the_guard_the_same_nan_corrupts_the_model(tiny_xtts, tmp_path) -> None:
    """The upstream fault the guard exists for (so the test above can fail)."""
    config = tiny_xtts.make_config(tmp_path / "run", epochs=1)
    model = tiny_xtts.make_model(config)
    poison_batch(model, 3)
    tiny_xtts.train(config, model)
    assert sum(not bool(torch.isfinite(p).all()) for p in model.parameters()) > 0


@pytest.mark.slow
def test_a_fused_skip_is_on_disk_when_the_next_checkpoint_is_written(
        tiny_xtts, tmp_path) -> None:
    """Fused AdamW (headlessXttsTrain.py's default): the guard reads its skip flags in
    batches, not per step. The Trainer's save reads them first, so a run killed after a
    checkpoint has every skip before it on disk: the skip of batch 3 is read at the save
    of step 4, not at the end of the run."""
    import json

    nan_guard.reset()
    patches.advanced.apply()
    config = tiny_xtts.make_config(tmp_path / "run", epochs=1, save_step=4,
                                   optimizer_params={"betas": [0.9, 0.96], "eps": 1e-8,
                                                     "weight_decay": 1e-2, "fused": True})
    model = tiny_xtts.make_model(config)
    poison_batch(model, 3)
    trainer = tiny_xtts.train(config, model)
    (optimizer,) = trainer.optimizer  # GPTTrainer's list of one
    assert optimizer.defaults["fused"]
    (event,) = [json.loads(line) for line in
                (Path(trainer.output_path) / nan_guard.EVENTS_FILE).read_text().splitlines()]
    assert event["kind"] == "nonfinite_loss" and event["trainer_step"] == 2
    # optimizer steps 1, 2, 3 (skipped), 4, 5 make trainer step 4, whose save reads the
    # flag; without it the flag waits for the end of the epoch (optimizer step 7)
    assert event["read_at_step"] == 5, event
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
