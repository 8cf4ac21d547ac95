"""What the ``f5_tts`` integration's sites do (declared in :mod:`patches.integrations.f5_tts`,
which imports this module when one lands), and the reading gap at each save
(:func:`watch_reading`, :func:`flow_matching_losses`)."""

from __future__ import annotations

import contextlib
import functools
import os
import types
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch

from ... import _run, learning, nan_guard, vocab_freeze
from ..._log import logger
from ..._registry import active, landed_sites
from .. import trainers
from ..layouts import f5_vocab_modules
from . import MODULE, NAME

if TYPE_CHECKING:  # imported where used: heavy (issue 41)
    from ...checkpoint import grown
    from ...checkpoint.ema import KeptRows


def _model(trainer: Any) -> torch.nn.Module:
    return trainer.accelerator.unwrap_model(trainer.model)


class _EmaRows:
    """Keeps the EMA's base rows while the model's are frozen: from the first ``update()``
    that finds a freeze of the model's text embedding, put back after every update
    (:class:`patches.checkpoint.ema.KeptRows`; a grown resume's loader keeps them already)."""

    def __init__(self, trainer: Any) -> None:
        self.ema = trainer.ema_model
        self.trainer = trainer
        self.kept: KeptRows | None = None
        self.started = False
        self.ema.update = self  # an instance attribute: the EMA's class is left alone

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.started:
            self.started = True
            if self.ema.__dict__.get("update") is self:  # nothing else wraps the update
                try:
                    self._start()
                except Exception as exc:  # noqa: BLE001 - never into the training step
                    self.kept = None
                    self.ema.__dict__["update"] = self
                    logger.warning("training-patches f5_tts: the EMA's base rows cannot be "
                                   "kept (%s: %s); the EMA updates as upstream's, training "
                                   "goes on", type(exc).__name__, str(exc)[:200])
        if self.kept is not None and self.ema.__dict__.get("update") is not self:
            return self.ema.update(*args, **kwargs)  # KeptRows' wrapper, from now on
        return type(self.ema).update(self.ema, *args, **kwargs)

    def _start(self) -> None:
        mine = f5_vocab_modules(_model(self.trainer))
        inner = getattr(self.ema, "ema_model", None)
        theirs = f5_vocab_modules(inner) if isinstance(inner, torch.nn.Module) else None
        handle = vocab_freeze.freeze_of(mine[0][0][1].weight) if mine else None
        if handle is None or theirs is None:
            return
        from ...checkpoint.ema import KeptRows  # lazy: heavy (issue 41)

        key = f"ema_model.{theirs[0][0][0]}.weight"
        del self.ema.__dict__["update"]  # KeptRows wraps the EMA's own update
        self.kept = KeptRows(self.ema, [key], handle.rows)
        logger.info("training-patches f5_tts: EMA weights: %s", self.kept.describe())

    def remove(self) -> None:
        if self.kept is not None:
            self.kept.remove()
        if self.ema.__dict__.get("update") is self:
            del self.ema.__dict__["update"]


def make_train(original: Any) -> Any:
    """``Trainer.train`` (:func:`.trainers.run_parts`): ``checkpoint_path`` claimed for this
    run on the main process; the records told where it writes, its updates counted, the
    EMA's base rows kept, and the fused steps' skip flags read at the end."""
    return trainers.run_parts(original, _recorded_run, _updates_counted)


def _recorded_run(trainer: Any) -> contextlib.AbstractContextManager[None]:
    """Claim ``checkpoint_path`` and record the start; the context records the end."""
    folder = getattr(trainer, "checkpoint_path", None)
    run = trainers.RunRecord(
        trainer=NAME, said=NAME_SAID, overwritten="model_last.pt and model_N.pt",
        step=lambda: int(_run.current().trainer_step or 0),
        checkpoint=lambda: latest_checkpoint(folder),
        continue_with="the same checkpoint_path (F5 resumes from model_last.pt)",
        writes=bool(trainer.accelerator.is_main_process))
    run.start(folder)
    return run.ending()


@contextlib.contextmanager
def _updates_counted(trainer: Any) -> Iterator[None]:
    _run.set_trainer_dir(getattr(trainer, "checkpoint_path", None))
    _run.current().trainer_step = 0  # load_checkpoint sets the update it resumes from

    def count(*_: Any) -> None:  # F5 counts every update, a skipped one too
        _run.current().trainer_step = (_run.current().trainer_step or 0) + 1

    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper
    hook = inner.register_step_post_hook(count)
    ema = _EmaRows(trainer) if hasattr(trainer, "ema_model") else None
    try:
        yield
        nan_guard.settle()
    finally:
        hook.remove()
        if ema is not None:
            ema.remove()


def make_save_checkpoint(original: Any) -> Any:
    """``Trainer.save_checkpoint(update, last)`` for two patches, each part run while its
    patch is applied. ``checkpoint``: the fused steps' waiting skips are recorded first and
    the file is written atomically. ``learning``: the reading gap of a trainer given to
    :func:`watch_reading` is measured after it."""
    @functools.wraps(original)
    def save_checkpoint(self: Any, update: Any, *args: Any, **kwargs: Any) -> Any:
        with contextlib.ExitStack() as parts:
            if active("checkpoint"):
                nan_guard.settle()
                parts.enter_context(_atomic_saves(self.accelerator))
            result = original(self, update, *args, **kwargs)
        if active("learning"):
            _measure_reading(self, update)
        return result
    return save_checkpoint


@contextlib.contextmanager
def _atomic_saves(accelerator: Any) -> Iterator[None]:
    """The main process's ``accelerator.save`` to a path goes through the atomic writer."""
    own = accelerator.__dict__.get("save")

    def save(obj: Any, f: Any, *a: Any, **k: Any) -> Any:
        if not accelerator.is_main_process or not isinstance(f, (str, os.PathLike)):
            return type(accelerator).save(accelerator, obj, f, *a, **k)
        from ...checkpoint.atomic import atomic_torch_save  # lazy: heavy (issue 41)

        return atomic_torch_save(obj, f)

    accelerator.save = save
    try:
        yield
    finally:
        if own is None:
            accelerator.__dict__.pop("save", None)
        else:
            accelerator.save = own


def latest_checkpoint(folder: str | os.PathLike[str]) -> Path | None:
    """The file F5-TTS 1.1's ``load_checkpoint`` resumes from: ``model_last.pt``, else the
    highest ``model_N.pt``, else a ``pretrained_*`` file; None when there is none."""
    try:
        names = os.listdir(folder)
    except OSError:
        return None
    if "model_last.pt" in names:
        return Path(folder, "model_last.pt")
    found = [n for n in names if n.startswith(("model_", "pretrained_"))
             and n.endswith((".pt", ".safetensors"))]
    training = [n for n in found if n.startswith("model_")]
    if training:
        return Path(folder, max(training, key=lambda n: int("".join(filter(str.isdigit, n)) or 0)))
    pretrained = [n for n in found if n.startswith("pretrained_")]
    return Path(folder, pretrained[0]) if pretrained else None


NAME_SAID = "F5's Trainer"


class CharVocab:
    """F5's ``vocab_char_map`` (character or pinyin syllable -> id) as the loader spells new
    tokens with it: a text is the ids of its characters that the vocabulary has."""

    def __init__(self, chars: dict[str, int]) -> None:
        self.ids = dict(chars)
        self.tokens = {i: c for c, i in chars.items()}

    def __len__(self) -> int:
        return len(self.ids)

    def get_vocab(self, with_added_tokens: bool = True) -> dict[str, int]:
        return dict(self.ids)

    def id_to_token(self, index: int) -> str | None:
        return self.tokens.get(index)

    def token_to_id(self, token: str) -> int | None:
        return self.ids.get(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> Any:
        return types.SimpleNamespace(ids=[self.ids[c] for c in text if c in self.ids])


def _tokenizer_of(trainer: Any) -> tuple[Any, str]:
    """The vocabulary the model was built with (``CFM.vocab_char_map``) and where; (None,
    why) when the model has none (it takes token ids)."""
    chars = getattr(_model(trainer), "vocab_char_map", None)
    cfg = getattr(trainer, "model_cfg_dict", None) or {}
    model_cfg = cfg.get("model", {}) if isinstance(cfg, dict) else {}
    named = model_cfg.get("tokenizer_path") if isinstance(model_cfg, dict) else None
    if not isinstance(chars, dict) or not chars:
        return None, "the model has no vocab_char_map (it is given token ids)"
    return CharVocab(chars), (f"the model's vocab_char_map ({len(chars)} entries"
                              + (f", from {named}" if named else "") + ")")


def _resume_of(trainer: Any, ckpt: dict[str, Any], update: int) -> grown.TrainerResume:
    """What F5's load restores itself after the weights, its update and its vocabulary."""
    keys = {"optimizer": "optimizer_state_dict", "step": "update" if "update" in ckpt else "step"}
    if getattr(trainer, "scheduler", None):
        keys["scheduler"] = "scheduler_state_dict"
    restores = {part: f"the checkpoint's {key!r}" for part, key in keys.items() if key in ckpt}
    tokenizer, source = _tokenizer_of(trainer)
    from ...checkpoint import grown  # lazy: heavy (issue 41)

    return grown.TrainerResume(NAME_SAID, restores, update, tokenizer, source)


def make_load_checkpoint(original: Any) -> Any:
    """``Trainer.load_checkpoint`` that also resumes into a model whose vocabulary grew since
    the save (upstream: a size mismatch); its update becomes the records' ``trainer_step``."""
    @functools.wraps(original)
    def load_checkpoint(self: Any) -> Any:
        from ...checkpoint import grown  # lazy: heavy (issue 41)

        path = latest_checkpoint(self.checkpoint_path) if self.checkpoint_path else None
        ema = getattr(self, "ema_model", None)  # rank 0's alone
        changes: dict[str, Any] = {}
        if path is not None and path.suffix == ".pt":
            shapes = grown.saved_shapes(path, "model_state_dict")
            changes = grown.vocabulary_growth(shapes, _model(self)) if shapes else {}
            if shapes == {} and ema is not None:  # EMA weights alone: a pretrained model
                saved = grown.saved_shapes(path, "ema_model_state_dict")
                if saved and grown.vocabulary_growth(saved, ema):
                    logger.warning(
                        "training-patches f5_tts: %s holds only EMA weights (a pretrained "
                        "model) of a smaller vocabulary than this model's; its load is "
                        "upstream's, which stops at the size mismatch. Grow it first (F5's "
                        "expand_model_embeddings), or save it as a training checkpoint "
                        "(model_state_dict, update) to resume through the library", path)
        if not changes:
            update = original(self)
        else:
            self.accelerator.wait_for_everyone()
            ckpt = torch.load(path, map_location="cpu", weights_only=True)  # as upstream reads
            update = int(ckpt["update"]) if "update" in ckpt else \
                int(ckpt.get("step", 0)) // self.grad_accumulation_steps
            rows = grown.load_grown(path, _model(self), set(shapes), ema=ema,
                                    resume=_resume_of(self, ckpt, update))
            self.optimizer.load_state_dict(ckpt["optimizer_state_dict"])
            grown.grow_loaded_moments(self.optimizer, rows)
            if self.scheduler:
                self.scheduler.load_state_dict(ckpt["scheduler_state_dict"])
            del ckpt
        _run.current().trainer_step = int(update)
        return update
    return load_checkpoint


# -- the reading gap at each save (patch ``learning``) -----------------------------------------

FLOW_MATCHING = "flow-matching loss"  # what a reading of F5 is measured on: its only loss
READING_SITE = f"{MODULE}.Trainer.save_checkpoint"
_watched: "weakref.WeakKeyDictionary[Any, learning.LearningMonitor]" = \
    weakref.WeakKeyDictionary()


def _mel_batch(model: Any, audio: Any) -> torch.Tensor:
    """One audio as a batch of one for ``CFM.forward``: a mel ``[frames, n_mel]`` (or
    ``[n_mel, frames]``, ``[1, n_mel, frames]``) or a raw wave ``[samples]``."""
    audio = torch.as_tensor(audio)
    if audio.dim() == 3 and audio.shape[0] == 1:
        audio = audio[0]
    channels = getattr(model, "num_channels", None)
    if audio.dim() == 2 and audio.shape[-1] != channels and audio.shape[0] == channels:
        audio = audio.T
    if audio.dim() not in (1, 2) or (audio.dim() == 2 and audio.shape[-1] != channels):
        raise ValueError(f"flow_matching_losses: an audio of shape {tuple(audio.shape)}: "
                         f"expected a mel [frames, {channels}] or a raw wave [samples]")
    return audio.unsqueeze(0).to(model.device, torch.float32)


def flow_matching_losses(model: Any, texts: list[Any], audios: list[Any]) -> list[float]:
    """F5-TTS's flow-matching loss of each (text, audio) pair, for a
    :class:`patches.advanced.LearningMonitor` (``measured_on=FLOW_MATCHING``)::

        probe = patches.advanced.ReadingProbe({"am": [(text, mel), ...]})  # mel: [frames, n_mel]
        monitor = patches.advanced.LearningMonitor(probe, f5_tts.flow_matching_losses,
                                                   measured_on=f5_tts.FLOW_MATCHING)

    ``model`` is F5's ``CFM``; a text what ``CFM.forward`` takes for one utterance (a string,
    characters or pinyin, a tensor of ids), an audio a mel ``[frames, n_mel]`` or a raw wave.
    Each pair is its own forward, with the seeded draws :func:`patches.learning.reading_gap`
    makes alike for both texts; CFM's drops of the text and audio condition are off meanwhile
    (a dropped text would make both losses equal)."""
    drops = (model.audio_drop_prob, model.cond_drop_prob)
    model.audio_drop_prob = model.cond_drop_prob = 0.0
    try:
        losses = []
        for text, audio in zip(texts, audios):
            ids = text.reshape(1, -1).to(model.device) if isinstance(text, torch.Tensor) \
                else [text]
            loss, _, _ = model(_mel_batch(model, audio), text=ids)
            losses.append(float(loss))
        return losses
    finally:
        model.audio_drop_prob, model.cond_drop_prob = drops


def watch_reading(trainer: Any, monitor: learning.LearningMonitor) -> learning.LearningMonitor:
    """Measure the reading gap of ``trainer`` (an F5 ``Trainer``, which has no evaluation
    loop) after each of its ``save_checkpoint`` calls (once per update: ``save_per_updates``,
    ``last_per_updates`` and the end), at F5's update count, on the main process::

        monitor = patches.advanced.LearningMonitor(probe, f5_tts.flow_matching_losses,
                                                   measured_on=f5_tts.FLOW_MATCHING)
        f5_tts.watch_reading(trainer, monitor)
        trainer.train(dataset)

    It measures the model being trained, not its EMA (a monitor on
    :func:`flow_matching_losses` at the default ``measured_on`` gets :data:`FLOW_MATCHING`),
    into ``learning_health.jsonl`` in ``checkpoint_path``. Without the ``learning`` patch it
    says once that nothing is measured; a monitor without ``loss_fn`` is a TypeError here.
    Returns the monitor."""
    checked = learning.checked_monitor(monitor, "f5_tts.watch_reading")
    if checked.loss_fn is flow_matching_losses and checked.measured_on == learning.AUDIO_LOSS:
        checked.measured_on = FLOW_MATCHING
    _watched[trainer] = checked
    if READING_SITE not in landed_sites("learning")[0]:
        learning.say_not_measured(
            "F5's Trainer.save_checkpoint is not wrapped (the learning patch is not applied, "
            "or the f5_tts integration is off), so watch_reading cannot measure at its saves: "
            "apply the patches first (import patches.auto)")
    return checked


def _measure_reading(trainer: Any, update: Any) -> None:
    monitor = _watched.get(trainer)
    if monitor is not None and trainer.accelerator.is_main_process:
        if _run.output_dir() is None:  # beside the checkpoints, as train()'s site puts them
            _run.set_trainer_dir(trainer.checkpoint_path)
        learning.evaluate_once(monitor, _model(trainer), int(update))
