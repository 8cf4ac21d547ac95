"""The reading gap inside the real coqui Trainer with XTTS's GPTTrainer: measured at every
evaluation from the Trainer's own evaluation batches, with XTTS's own audio loss per
utterance; a run that cannot be measured says so; a coqui resume is checked."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

import patches
from patches.integrations import coqui_learning

pytestmark = pytest.mark.xtts


def fit_with_eval(tiny, tmp_path, *, epochs: int = 2, run_eval: bool = True, **overrides):
    from trainer import Trainer, TrainerArgs

    config = tiny.make_config(tmp_path / "run", epochs=epochs, run_eval=run_eval, **overrides)
    samples = tiny.samples(config)
    trainer = Trainer(TrainerArgs(), config, config.output_path, model=tiny.make_model(config),
                      train_samples=samples, eval_samples=samples[:8] if run_eval else None,
                      parse_command_line_args=False)
    trainer.fit()
    return trainer


def learning_records(trainer) -> list[dict]:
    path = os.path.join(trainer.output_path, "learning_health.jsonl")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


def test_xtts_reading_is_measured_at_every_coqui_evaluation(tiny_xtts, tmp_path,
                                                            caplog, monkeypatch) -> None:
    patches.advanced.apply(reading_budget=1.0)  # a tiny epoch is seconds: no time budget here
    caplog.set_level(logging.INFO, logger="training_patches")
    from patches import learning
    from trainer import Trainer

    in_step, during_step = [False], []
    train_step, measure = Trainer.train_step, learning.reading_gap

    def flagged(self, *args, **kwargs):
        in_step[0] = True
        try:
            return train_step(self, *args, **kwargs)
        finally:
            in_step[0] = False

    def watched(*args, **kwargs):
        during_step.append(in_step[0])
        return measure(*args, **kwargs)
    monkeypatch.setattr(Trainer, "train_step", flagged)
    monkeypatch.setattr(learning, "reading_gap", watched)
    trainer = fit_with_eval(tiny_xtts, tmp_path)
    assert during_step == [False, False]  # measured twice, never inside a training step
    events = learning_records(trainer)
    probe = [e for e in events if e["event"] == "probe"]
    readings = [e for e in events if e["event"] == "reading"]
    assert probe[0]["languages"] == {"en": 8} and probe[0]["measured_on"] == "audio loss"
    # one evaluation per epoch, at the Trainer's own step (7 batches an epoch)
    assert [(r["language"], r["step"]) for r in readings] == [("en", 7), ("en", 14)]
    assert all(r["utterances"] == 8 and r["own"] > 0 and r["rotated"] > 0 for r in readings)
    assert "reading en at step 14: gap" in caplog.text
    # the probe was chosen at the first evaluation and kept
    monitor = coqui_learning.monitor_of(trainer)
    assert monitor.probe.frozen and len(monitor.points) == 2
    assert monitor.points[1].eval_loss == pytest.approx(
        trainer.keep_avg_eval.avg_values["avg_loss"])


def test_the_per_utterance_losses_are_xtts_own_loss_mel(tiny_xtts, tmp_path) -> None:
    patches.advanced.apply()
    trainer = fit_with_eval(tiny_xtts, tmp_path, epochs=1)
    model = trainer.model
    model.eval()
    pairs = coqui_learning.monitor_of(trainer).probe.pairs("en")
    texts, audios = [t for t, _ in pairs], [a for _, a in pairs]
    with torch.no_grad():
        batched = coqui_learning.audio_losses(model, texts, audios)
        alone = [float(coqui_learning.audio_losses(model, [t], [a])) for t, a in pairs]
        _, loss_mel, _ = model.xtts.gpt(
            coqui_learning._pad(texts), torch.tensor([len(t) for t in texts]),
            coqui_learning._pad([a["codes"] for a in audios]),
            torch.tensor([a["wav_length"] for a in audios]),
            cond_mels=coqui_learning._pad([a["cond_mels"] for a in audios]))
    assert batched.shape == (8,)
    assert batched.tolist() == pytest.approx(alone, rel=1e-4)
    codes = torch.tensor([len(a["codes"]) - 2 for a in audios], dtype=torch.float)  # +1 stop
    assert float((batched * codes).sum() / codes.sum()) == pytest.approx(float(loss_mel),
                                                                         rel=1e-3)


def test_a_coqui_run_without_evaluations_is_told_once(tiny_xtts, tmp_path,
                                                      caplog) -> None:
    patches.advanced.apply()
    trainer = fit_with_eval(tiny_xtts, tmp_path, epochs=2, run_eval=False)
    said = [r.getMessage() for r in caplog.records if "reading gap is not measured" in
            r.getMessage()]
    assert len(said) == 1 and "run_eval is off" in said[0]
    assert [e["event"] for e in learning_records(trainer)] == ["not_measured"]


def test_with_learning_off_nothing_is_measured(tiny_xtts, tmp_path,
                                               monkeypatch) -> None:
    monkeypatch.setenv("TRAINING_PATCHES_DISABLE", "learning")
    patches.advanced.apply()
    trainer = fit_with_eval(tiny_xtts, tmp_path, epochs=1)
    assert [e for e in learning_records(trainer) if e["event"] == "reading"] == []


def test_a_coqui_continue_path_resume_is_checked(tiny_xtts, tmp_path,
                                                 caplog) -> None:
    patches.advanced.apply()
    caplog.set_level(logging.INFO, logger="training_patches")
    config = tiny_xtts.make_config(tmp_path / "run", epochs=1, save_step=4)
    first = tiny_xtts.train(config)
    config.epochs = 2
    resumed = tiny_xtts.train(config, continue_path=first.output_path)
    (check,) = [e for e in learning_records(resumed) if e["event"] == "resume"]
    assert check["problems"] == [] and check["source"] == "coqui continue_path"
    assert check["optimizer_steps"] > 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING
                and r.getMessage().startswith("resume_check")]
