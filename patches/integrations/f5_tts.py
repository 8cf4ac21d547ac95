"""Integration ``f5_tts``: F5-TTS's own ``Trainer`` (``f5_tts.model.trainer``, 1.1.x), on
accelerate, with an ``ema_pytorch`` EMA model and fused AdamW.

The generic patches already hold every name its step goes through: ``accelerator.backward``
calls ``Tensor.backward`` (the NaN guard sees the loss), ``accelerator.clip_grad_norm_``
calls ``torch.nn.utils.clip_grad_norm_``, and ``optimizer.step()`` reaches the guard's hooks
(its fused AdamW skips a bad step on the device, by the guard's ``found_inf``). The
vocabulary layout (``text_embed`` with its filler row 0, no head) is
:data:`patches.integrations.layouts.F5_FILLER`, so ``TRAINING_PATCHES_BASE_VOCAB`` and
``freeze_base_vocab`` find it.

What this adds:

- the run's records (``nonfinite_events.jsonl``, ...) go to the Trainer's
  ``checkpoint_path`` instead of ``./training_patches`` (a folder the user set still wins),
  each carrying F5's update count as its ``trainer_step``;
- the fused steps' skip flags, read by the guard in batches, are read at each
  ``save_checkpoint`` and when ``train()`` ends, so a skip just before a save or the end is
  on disk by then;
- the EMA's base rows are kept bit-identical while the model's are frozen (``update()``
  lerps every row toward the model, and a resumed EMA's base rows need not equal the
  model's);
- ``save_checkpoint`` writes ``model_last.pt`` and ``model_N.pt`` atomically (upstream
  writes them in place: a kill or a full disk during a save leaves a torn
  ``model_last.pt``, which the next start picks first and cannot read, the good one gone);
- ``load_checkpoint`` into a model whose vocabulary grew since the save (upstream: a size
  mismatch) loads the model and EMA weights through ``patches.load_checkpoint`` (trained
  rows kept, new rows by the row rules, the EMA's new rows as the model's, the base rows
  frozen in both) and grows the loaded moments of the grown rows.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch

from .. import _run, nan_guard, vocab_freeze
from .._log import logger
from .._registry import Integration, Site, register_integration
from ..checkpoint import atomic_torch_save, grown
from ..checkpoint.ema import KeptRows
from .layouts import f5_vocab_modules

NAME = "f5_tts"
DISTRIBUTION = "f5-tts"
SUPPORTED = ">=1.1,<1.2"
MODULE = "f5_tts.model.trainer"


def _inner(optimizer: Any) -> Any:
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer


def _model(trainer: Any) -> torch.nn.Module:
    return trainer.accelerator.unwrap_model(trainer.model)


class _EmaRows:
    """Keeps the EMA's base rows while the model's are frozen: at the first ``update()``,
    when a freeze of the model's text embedding exists, the EMA's rows are taken as they
    are and put back after every update (:class:`patches.checkpoint.ema.KeptRows`). A
    resume into a grown vocabulary keeps them already (the loader's own KeptRows)."""

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
    """``Trainer.train`` that tells the patches where the Trainer writes and how it counts
    its updates, keeps the EMA's base rows with the model's, and reads the fused steps'
    waiting skip flags when training ends."""
    @functools.wraps(original)
    def train(self: Any, *args: Any, **kwargs: Any) -> Any:
        _run.set_trainer_dir(getattr(self, "checkpoint_path", None))
        _run.trainer_step = 0  # load_checkpoint sets the update it resumes from

        def count(*_: Any) -> None:  # F5 counts every update, a skipped one too
            _run.trainer_step = (_run.trainer_step or 0) + 1

        hook = _inner(self.optimizer).register_step_post_hook(count)
        ema = _EmaRows(self) if hasattr(self, "ema_model") else None
        try:
            result = original(self, *args, **kwargs)
            nan_guard.settle()
            return result
        finally:
            hook.remove()
            if ema is not None:
                ema.remove()
    return train


def make_save_checkpoint(original: Any) -> Any:
    """``Trainer.save_checkpoint`` that records the fused steps' waiting skips first and
    writes the file atomically (a temporary file beside it, fsync, ``os.replace``)."""
    @functools.wraps(original)
    def save_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
        nan_guard.settle()
        accelerator = self.accelerator
        own = accelerator.__dict__.get("save")

        def save(obj: Any, f: Any, *a: Any, **k: Any) -> Any:
            if not accelerator.is_main_process or not isinstance(f, (str, os.PathLike)):
                return type(accelerator).save(accelerator, obj, f, *a, **k)
            return atomic_torch_save(obj, f)

        accelerator.save = save
        try:
            return original(self, *args, **kwargs)
        finally:
            if own is None:
                accelerator.__dict__.pop("save", None)
            else:
                accelerator.save = own
    return save_checkpoint


def latest_checkpoint(folder: str | os.PathLike[str]) -> Path | None:
    """The file F5-TTS 1.1's ``load_checkpoint`` resumes from: ``model_last.pt``, else the
    highest ``model_N.pt``, else a ``pretrained_*`` file; None when there is none."""
    try:
        names = os.listdir(folder)
    except OSError:
        return None
    if "model_last.pt" in names:
        return Path(folder, "model_last.pt")
    found = [n for n in names if (n.startswith("model_") or n.startswith("pretrained_"))
             and n.endswith((".pt", ".safetensors"))]
    training = [n for n in found if n.startswith("model_")]
    if training:
        return Path(folder, max(training, key=lambda n: int("".join(filter(str.isdigit, n))
                                                            or 0)))
    pretrained = [n for n in found if n.startswith("pretrained_")]
    return Path(folder, pretrained[0]) if pretrained else None


def make_load_checkpoint(original: Any) -> Any:
    """``Trainer.load_checkpoint`` that resumes a training checkpoint into a model whose
    vocabulary grew since it was saved (upstream: a size-mismatch error); upstream's load
    otherwise. The update it resumes from becomes the records' ``trainer_step``."""
    @functools.wraps(original)
    def load_checkpoint(self: Any) -> Any:
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
            rows = grown.load_grown(path, _model(self), set(shapes), ema=ema)
            self.optimizer.load_state_dict(ckpt["optimizer_state_dict"])
            grown.grow_loaded_moments(self.optimizer, rows)
            if self.scheduler:
                self.scheduler.load_state_dict(ckpt["scheduler_state_dict"])
            update = int(ckpt["update"]) if "update" in ckpt else \
                int(ckpt.get("step", 0)) // self.grad_accumulation_steps
            del ckpt
        _run.trainer_step = int(update)
        return update
    return load_checkpoint


INTEGRATION = register_integration(Integration(
    name=NAME,
    distribution=DISTRIBUTION,
    supported=SUPPORTED,
    module="f5_tts",
    describe="records in the Trainer's checkpoint_path with its update count, the fused "
             "optimizer's skips recorded by each save and the end of train(), the EMA's "
             "base rows kept with the model's, checkpoints written atomically, a resume "
             "into a grown vocabulary",
    sites=(
        Site(MODULE, "Trainer.train", make_train, patch="nan_guard",
             lost="an F5-TTS run's records go to ./training_patches, not its checkpoint "
                  "folder, carry no trainer step, a fused step's skip near the end is "
                  "written only at exit, and the EMA's base rows drift while the model's "
                  "are frozen"),
        Site(MODULE, "Trainer.save_checkpoint", make_save_checkpoint, patch="checkpoint",
             lost="a kill or a full disk during an F5-TTS save leaves a torn model_last.pt "
                  "that the next start cannot read"),
        Site(MODULE, "Trainer.load_checkpoint", make_load_checkpoint, patch="checkpoint",
             lost="an F5-TTS resume into a model whose vocabulary grew stops at a size "
                  "mismatch"),
    ),
))
