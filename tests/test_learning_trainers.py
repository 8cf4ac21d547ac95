"""The reading gap (patch ``learning``) in the trainers whose loss on a (text, audio) pair
the library cannot know by itself: the Hugging Face Trainer and Lightning take
``reading_callback(monitor)``; F5-TTS's Trainer, which has no evaluation loop, takes
``watch_reading(trainer, monitor)`` and is measured at each save. Each real trainer trains
a few steps: one ``reading`` record per language per evaluation in the trainer's own
folder, at the trainer's own step, the log line, the model's training modes and every RNG
state as they were before each measurement; and a run whose transcripts do not match their
audio is named (``learning: not reading the text``) while one whose audio follows its text
is not."""

from __future__ import annotations

import functools
import importlib.util
import itertools
import json
import logging
import math
import pickle
import random
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import patches
from patches import _run, learning
from patches.integrations import f5_tts, transformers_trainer
from patches.integrations import lightning as lightning_integration

LANGUAGES = ("am", "xx")
NOT_READING = "learning: not reading the text"
f5_only = pytest.mark.skipif(importlib.util.find_spec("f5_tts") is None,
                             reason="f5-tts is not installed (make test installs it)")


def _records(folder: Path, event: str) -> list[dict[str, Any]]:
    lines = (folder / _run.LEARNING_FILE).read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]


def _readings(folder: Path) -> list[tuple[int, str]]:
    """(step, language) of each reading record in ``folder``, each with finite losses."""
    found = _records(folder, "reading")
    assert all(math.isfinite(r["own"]) and math.isfinite(r["rotated"]) for r in found), found
    return [(r["step"], r["language"]) for r in found]


def _state(model: torch.nn.Module) -> tuple[Any, ...]:
    numpy = np.random.get_state()
    return (torch.get_rng_state().numpy().tobytes(), random.getstate(), numpy[0],
            numpy[1].tobytes(), *numpy[2:], tuple(m.training for m in model.modules()))


class Snapshots:
    """The model's training modes and torch's, Python's and numpy's RNG states right before
    and right after the measurement, at each evaluation (a spy on each side of it)."""

    def __init__(self) -> None:
        self.pairs: list[list[tuple[Any, ...]]] = []

    def before(self, model: torch.nn.Module) -> None:
        self.pairs.append([_state(model)])

    def after(self, model: torch.nn.Module) -> None:
        self.pairs[-1].append(_state(model))

    def assert_unchanged(self, evaluations: int) -> None:
        assert len(self.pairs) == evaluations
        assert all(len(pair) == 2 and pair[0] == pair[1] for pair in self.pairs)


def _assert_pickles(callbacks: list[Any]) -> None:
    """The reading callback among ``callbacks`` pickles, as a Trainer copied or spawned
    with its callbacks needs, and comes back with its monitor."""
    (ours,) = [c for c in callbacks if type(c).__name__ == "ReadingCallback"]
    again = pickle.loads(pickle.dumps(ours))
    assert type(again) is type(ours) and again.monitor.loss_fn is ours.monitor.loss_fn


@pytest.fixture
def every_evaluation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Measured at every evaluation: ``reading_budget`` leaves out an evaluation that comes
    sooner after the last measurement than that measurement took, which a tiny model's few
    steps on a busy machine can. Here learning's clock ticks one second per look, and with
    ``reading_budget=1`` no evaluation is too soon."""
    ticks = itertools.count()
    monkeypatch.setattr(learning, "time", types.SimpleNamespace(
        perf_counter=lambda: float(next(ticks))))


@pytest.mark.parametrize("make", ["transformers_trainer", "lightning", "f5_tts"])
def test_a_monitor_without_its_loss_is_refused_when_the_helper_is_made(make: str) -> None:
    """The trainer cannot tell the library how to run the model on a pair: a monitor
    without ``loss_fn`` (or a probe given for a monitor) is a TypeError at once, not a
    silence at the first evaluation."""
    class Trainer:
        pass

    helper = {"transformers_trainer": transformers_trainer.reading_callback,
              "lightning": lightning_integration.reading_callback,
              "f5_tts": functools.partial(f5_tts.watch_reading, Trainer())}[make]
    with pytest.raises(TypeError, match=r"was given a LearningMonitor without loss_fn: the "
                                        r"trainer cannot tell"):
        helper(learning.LearningMonitor(learning.ReadingProbe()))
    with pytest.raises(TypeError, match=r"needs a LearningMonitor .* was given ReadingProbe"):
        helper(learning.ReadingProbe())


def test_watch_reading_without_the_learning_patch_says_nothing_is_measured(trainer_env, caplog
                                                                          ) -> None:
    """F5's saves are wrapped by the ``learning`` patch: without it, ``watch_reading`` says
    once that the reading gap goes unmeasured, and records it."""
    class Trainer:
        pass

    patches.advanced.reset_runtime_state()
    monitor = learning.LearningMonitor(learning.ReadingProbe(), f5_tts.flow_matching_losses)
    with caplog.at_level(logging.WARNING, logger="training_patches"):
        assert f5_tts.watch_reading(Trainer(), monitor) is monitor
    assert "the reading gap is not measured: F5's Trainer.save_checkpoint is not wrapped" \
        in caplog.text
    assert monitor.measured_on == f5_tts.FLOW_MATCHING
    (said,) = _records(Path("training_patches"), "not_measured")
    assert "the learning patch is not applied" in said["reason"]


# -- the Hugging Face Trainer: a GPT-2 whose "audio" token follows each text token -----------

TEXT = 6  # text tokens (ids 0-31), each followed by its "audio" token: the text token + 32
EVAL_STEPS, HF_STEPS = 7, 28  # evaluations at global steps 7, 14, 21 and 28


def _text_audio_pairs(n: int, seed: int, shuffled: bool = False) -> list[tuple[torch.Tensor, ...]]:
    """(text, audio) pairs whose audio is a function of the text; ``shuffled``: the audio
    of another pair (transcripts that do not match their audio)."""
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(0, 32, (n, TEXT), generator=g)
    audio = text + 32
    if shuffled:
        audio = audio[torch.randperm(n, generator=g)]
    return list(zip(text, audio))


def _interleaved(text: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
    """``t0 a0 t1 a1 ...``: each audio token after the text token it is said from."""
    return torch.stack([text, audio], -1).flatten(-2)


def audio_token_loss(model: torch.nn.Module, texts: list[torch.Tensor],
                     audios: list[torch.Tensor]) -> torch.Tensor:
    """The GPT's cross entropy on each pair's audio tokens, each after its text token."""
    ids = _interleaved(torch.stack(texts), torch.stack(audios)).to(model.device)
    logits = model(input_ids=ids).logits[:, 0::2]
    return F.cross_entropy(logits.transpose(1, 2), ids[:, 1::2], reduction="none").mean(1)


def _probe(pairs: list[Any]) -> learning.ReadingProbe:
    half = len(pairs) // 2
    return learning.ReadingProbe({LANGUAGES[0]: pairs[:half], LANGUAGES[1]: pairs[half:]})


def _hf_run(folder: Path, shuffled: bool) -> tuple[Any, Snapshots]:
    """Train the GPT on the pairs (loss on the audio tokens only), evaluating every
    EVAL_STEPS steps with the reading callback between two spies."""
    transformers = pytest.importorskip("transformers")
    from test_transformers_trainer import _model

    def rows(pairs: list[Any]) -> list[dict[str, torch.Tensor]]:
        return [{"input_ids": _interleaved(t, a), "labels": _interleaved(torch.full_like(t, -100),
                                                                         a)} for t, a in pairs]

    snapshots = Snapshots()

    class Before(transformers.TrainerCallback):
        def on_evaluate(self, args: Any, state: Any, control: Any, model: Any = None,
                        **kwargs: Any) -> None:
            snapshots.before(model)

    class After(transformers.TrainerCallback):
        def on_evaluate(self, args: Any, state: Any, control: Any, model: Any = None,
                        **kwargs: Any) -> None:
            snapshots.after(model)

    probe = _probe(_text_audio_pairs(16, 3, shuffled))
    monitor = learning.LearningMonitor(probe, audio_token_loss)
    args = transformers.TrainingArguments(
        output_dir=str(folder), max_steps=HF_STEPS, per_device_train_batch_size=16,
        per_device_eval_batch_size=16, eval_strategy="steps", eval_steps=EVAL_STEPS,
        report_to=[], save_strategy="no", use_cpu=True, logging_steps=1000, seed=0,
        learning_rate=1e-2, lr_scheduler_type="constant", disable_tqdm=True)
    trainer = transformers.Trainer(
        model=_model(), args=args, train_dataset=rows(_text_audio_pairs(256, 1, shuffled)),
        eval_dataset=rows(_text_audio_pairs(16, 2, shuffled)),
        callbacks=[Before(), transformers_trainer.reading_callback(monitor), After()])
    trainer.train()
    return trainer, snapshots


@pytest.mark.slow
def test_hf_trainer_reads_at_each_evaluation_at_its_global_step(
        trainer_env, every_evaluation, tmp_path, caplog) -> None:
    """One reading per language at each of the Trainer's evaluations (global steps 7 to
    28), in output_dir, with the Trainer's eval_loss; the model's modes and every RNG state
    as before each; a model whose audio follows its text is not named."""
    patches.advanced.apply(["learning"], reading_budget=1)
    with caplog.at_level(logging.INFO, logger="training_patches"):
        trainer, snapshots = _hf_run(tmp_path / "out", shuffled=False)
    steps = list(range(EVAL_STEPS, HF_STEPS + 1, EVAL_STEPS))
    assert _readings(tmp_path / "out") == [(s, lang) for s in steps for lang in LANGUAGES]
    logged = {e["step"]: e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e}
    assert sorted(logged) == steps
    for record in _records(tmp_path / "out", "reading"):
        assert record["eval_loss"] == pytest.approx(logged[record["step"]])
        assert record["measured_on"] == learning.AUDIO_LOSS
    assert all(f"reading {lang} at step {s}: gap" in caplog.text for s in steps
               for lang in LANGUAGES)
    snapshots.assert_unchanged(len(steps))
    _assert_pickles(trainer.callback_handler.callbacks)
    last = _records(tmp_path / "out", "reading")[-2:]
    assert all(r["relative"] > 0.05 and r["share"] == 1.0 for r in last), last  # it reads
    assert NOT_READING not in caplog.text
    assert not (tmp_path / "training_patches").exists()


@pytest.mark.slow
def test_hf_trainer_names_a_run_whose_transcripts_do_not_match(
        trainer_env, every_evaluation, tmp_path, caplog) -> None:
    """The same run with each audio given another utterance's text: the audio loss cannot
    use the text and the gap stays near 0. Past the warmup (the first evaluation), two
    evaluations in a row under reading_min_gap make the verdict, once: a WARNING and a
    record at step 21 for each language, true since step 7."""
    patches.advanced.apply(["learning"], reading_budget=1)
    with caplog.at_level(logging.INFO, logger="training_patches"):
        _hf_run(tmp_path / "out", shuffled=True)
    for lang in LANGUAGES:
        assert f"{NOT_READING} ({lang}) since step {EVAL_STEPS}:" in caplog.text
    verdicts = _records(tmp_path / "out", "verdict")
    assert [(v["step"], v["kind"], v["language"]) for v in verdicts] == \
        [(3 * EVAL_STEPS, learning.NOT_READING, lang) for lang in LANGUAGES]


# -- Lightning: a reader whose audio token is a function of the text token under it -----------


@functools.cache
def _reader_class() -> type:
    lightning = pytest.importorskip("lightning")
    from tiny_models import TinyGPT

    class Reader(lightning.LightningModule):
        """TinyGPT (with dropout: it draws on torch's RNG while training) predicting each
        audio token (text + 8) from the text token at its place; logs val_loss."""

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = TinyGPT(16, dropout=0.1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return reader_loss(self, list(batch[0]), list(batch[1])).mean()

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", reader_loss(self, list(batch[0]), list(batch[1])).mean())

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def _data(self, seed: int) -> Any:
            g = torch.Generator().manual_seed(seed)
            text = torch.randint(0, 8, (64, TEXT), generator=g)
            data = torch.utils.data.TensorDataset(text, text + 8)
            return torch.utils.data.DataLoader(data, batch_size=8)

        def train_dataloader(self) -> Any:
            return self._data(1)

        def val_dataloader(self) -> Any:
            return self._data(2)

    return Reader


def reader_loss(module: Any, texts: list[torch.Tensor], audios: list[torch.Tensor]
                ) -> torch.Tensor:
    logits = module.model(torch.stack(texts))
    return F.cross_entropy(logits.transpose(1, 2), torch.stack(audios), reduction="none").mean(1)


@pytest.mark.slow
def test_lightning_reads_after_each_validation_at_its_global_step(
        trainer_env, every_evaluation, tmp_path, caplog) -> None:
    """Validation every 4 batches of an 8-step fit (and the sanity check first, which is
    not measured): one reading per language at global steps 4 and 8, in the Trainer's
    folder, with the logged val_loss; the module's modes and every RNG state as before."""
    lightning = pytest.importorskip("lightning")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    patches.advanced.apply(["learning"], reading_budget=1)
    snapshots, seen = Snapshots(), []

    class Before(lightning.Callback):
        def on_validation_end(self, trainer: Any, module: Any) -> None:
            if not trainer.sanity_checking:
                snapshots.before(module)
                seen.append((trainer.global_step, float(trainer.callback_metrics["val_loss"])))

    class After(lightning.Callback):
        def on_validation_end(self, trainer: Any, module: Any) -> None:
            if not trainer.sanity_checking:
                snapshots.after(module)

    g = torch.Generator().manual_seed(3)
    text = torch.randint(0, 8, (8, TEXT), generator=g)
    monitor = learning.LearningMonitor(_probe(list(zip(text, text + 8))), reader_loss)
    trainer = lightning.Trainer(
        max_steps=8, val_check_interval=4, limit_val_batches=1, num_sanity_val_steps=1,
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path / "root"),
        callbacks=[Before(), lightning_integration.reading_callback(monitor), After()])
    _assert_pickles(trainer.callbacks)  # ddp_spawn pickles the Trainer with its callbacks
    with caplog.at_level(logging.INFO, logger="training_patches"):
        trainer.fit(_reader_class()())
    assert [s for s, _ in seen] == [4, 8]
    assert _readings(tmp_path / "root") == [(s, lang) for s, _ in seen for lang in LANGUAGES]
    losses = dict(seen)
    for record in _records(tmp_path / "root", "reading"):
        assert record["eval_loss"] == pytest.approx(losses[record["step"]])
    assert all(f"reading {lang} at step {s}: gap" in caplog.text for s, _ in seen
               for lang in LANGUAGES)
    snapshots.assert_unchanged(2)


def test_lightning_reading_asks_the_folder_on_every_rank(trainer_env, tmp_path) -> None:
    """Under DDP Lightning's ``trainer.log_dir`` is a broadcast every rank must join: the
    reading callback asks it on every rank (rank 0 alone would wait for ever), and only rank
    0 measures. The learning patch alone leaves the folder to the callback (no fit site)."""
    pytest.importorskip("lightning")
    patches.advanced.apply(["learning"], reading_budget=1)
    measured: list[int] = []

    class Trainer:  # what the callback reads of Lightning's Trainer, with a counted log_dir
        sanity_checking, global_step, callback_metrics = False, 4, {}
        default_root_dir = str(tmp_path / "root")

        def __init__(self, rank: int) -> None:
            self.is_global_zero, self.asked = rank == 0, 0

        @property
        def log_dir(self) -> str:
            self.asked += 1  # strategy.broadcast(dirpath) in Lightning
            return str(tmp_path / "logs")

    monitor = learning.LearningMonitor(_probe([(torch.zeros(2), torch.zeros(2))] * 4),
                                       lambda module, texts, audios: torch.zeros(len(texts)))
    callback = lightning_integration.reading_callback(monitor)
    original = learning.evaluate_once
    try:
        learning.evaluate_once = lambda monitor, module, step, **kw: measured.append(step)
        for rank in (1, 0):
            run = _run.current()
            run.output_dir = run.trainer_dir = None  # each rank's process: nothing set yet
            trainer = Trainer(rank)
            callback.on_validation_end(trainer, None)
            assert trainer.asked == 1, f"rank {rank} did not join log_dir's broadcast"
    finally:
        learning.evaluate_once = original
    assert measured == [4]  # rank 0 only


# -- F5-TTS: no evaluation loop; the monitor runs at each save, at F5's update count -----------


def _f5_probe() -> learning.ReadingProbe:
    from test_f5_tts import CHARS, FRAMES, MELS

    g = torch.Generator().manual_seed(3)
    pairs = [("".join(CHARS[j] for j in torch.randint(0, 26, (6,), generator=g)),
              torch.randn(FRAMES, MELS, generator=g)) for _ in range(8)]
    return _probe(pairs)


@f5_only
@pytest.mark.slow
def test_f5_flow_matching_losses_compare_texts_on_equal_draws(trainer_env) -> None:
    """F5's loss is random (span, time, noise): measured on a probe whose utterances all
    have one text, the own and the other text give the same loss to the bit (the draws
    are paired, CFM's text drop is off), and a second measurement gives the same
    figures; CFM's drop rates are as before."""
    from test_f5_tts import _f5, _model

    model = _model(cfm=_f5().CFM)
    probe = _f5_probe()
    same = learning.ReadingProbe({"am": [("abcdef", audio) for _, audio in probe.pairs("am")]})
    (reading,) = learning.reading_gap(model, same, f5_tts.flow_matching_losses).values()
    assert reading.own == reading.rotated and math.isfinite(reading.own) and reading.own > 0
    first = learning.reading_gap(model, probe, f5_tts.flow_matching_losses)
    assert learning.reading_gap(model, probe, f5_tts.flow_matching_losses) == first
    assert (model.audio_drop_prob, model.cond_drop_prob) == (0.3, 0.2)


@f5_only
@pytest.mark.slow
def test_f5_trainer_reads_at_each_save_at_its_update(trainer_env, every_evaluation, tmp_path,
                                                     caplog) -> None:
    """8 updates, save_per_updates=3: F5 saves twice at updates 3 and 6 (model_last.pt and
    model_N.pt) and once at the end (8); one reading per language at each of those updates,
    in checkpoint_path, on the flow-matching loss; the model (training) and every RNG
    state as before each save."""
    from test_f5_tts import Clips, _f5, _model, _trainer

    patches.advanced.apply(["learning"], reading_budget=1)
    model = _model(cfm=_f5().CFM)
    trainer = _trainer(model, tmp_path / "ckpts", save_per_updates=3)
    monitor = learning.LearningMonitor(_f5_probe(), f5_tts.flow_matching_losses)
    assert f5_tts.watch_reading(trainer, monitor) is monitor
    assert monitor.measured_on == f5_tts.FLOW_MATCHING
    snapshots, saves = Snapshots(), []

    def save_checkpoint(update: int, *args: Any, **kwargs: Any) -> Any:
        saves.append(update)
        snapshots.before(model)
        result = type(trainer).save_checkpoint(trainer, update, *args, **kwargs)
        snapshots.after(model)
        return result

    trainer.save_checkpoint = save_checkpoint  # the spy: F5 calls self.save_checkpoint
    with caplog.at_level(logging.INFO, logger="training_patches"):
        trainer.train(Clips(), num_workers=1)
    assert saves == [3, 3, 6, 6, 8]
    assert _readings(tmp_path / "ckpts") == [(u, lang) for u in (3, 6, 8) for lang in LANGUAGES]
    records = _records(tmp_path / "ckpts", "reading")
    assert {r["measured_on"] for r in records} == {f5_tts.FLOW_MATCHING}
    assert all(r["eval_loss"] is None for r in records)
    assert "reading am at step 3: gap" in caplog.text and "(flow-matching loss)" in caplog.text
    snapshots.assert_unchanged(len(saves))
    assert all(pair[0][-1] == (True,) * len(pair[0][-1]) for pair in snapshots.pairs)
