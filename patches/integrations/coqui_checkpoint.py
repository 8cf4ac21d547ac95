"""``checkpoint``: the coqui Trainer and XTTS load and save checkpoints through training-patches.

Sites (coqui-tts-trainer 0.4, coqui-tts 0.28), all reversible through the registry:

- ``trainer.trainer.Trainer.restore_model``: ``restore_path`` and ``continue_path``
  load with :func:`patches.checkpoint.load_checkpoint`. Upstream falls back to a
  partial load that drops every tensor whose shape changed (74 -> 82 tokens: 0 of 74
  trained rows kept) and restores scheduler and scaler even when the optimizer did not
  load. Here a grown vocabulary is resized (rows kept, new rows at the old mean, the
  base rows frozen), any other mismatch is an error, and ``continue_path`` restores
  optimizer, scheduler and scaler as one set (``TRAINING_PATCHES_RESUME_POLICY``:
  ``remap``, or ``reset`` to start all three fresh). ``restore_path`` alone loads the
  weights only, as upstream does.
- ``trainer.io.save_fsspec``: every coqui checkpoint (``checkpoint_N.pth``,
  ``best_model_N.pth``) is written atomically (temporary file in the same folder,
  fsync, ``os.replace``). Remote (fsspec URL) paths go to the original.
- ``trainer.trainer.get_last_checkpoint``: ``continue_path`` resumes from the newest
  checkpoint that validates; upstream trusts the newest name, torn or not.
- ``TTS...gpt_trainer.GPTTrainer.load_checkpoint``: ``xtts_checkpoint`` loads through
  the same loader (a vocabulary growth is resized instead of failing).

- ``TTS...gpt_trainer.GPTTrainer.__init__``: ``gpt_checkpoint`` loads through the same
  loader instead of coqui's, which pads new vocabulary rows with ``torch.randn`` (std 1,
  about 50 times the model's own init). ``vocab_freeze`` wraps the same method; the
  registry composes the two (this layer inside, the freeze around it).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Callable

import torch

from .. import _options
from .._log import info, logger
from .._registry import PatchSpec, Site, register
from ..checkpoint import (CheckpointError, atomic_torch_save, check_file, load_checkpoint)

SUPPORTED = "coqui-tts-trainer >= 0.3, < 0.5; coqui-tts >= 0.24, < 0.30"
TRAINER = "trainer.trainer"
IO = "trainer.io"
GPT_TRAINER = "TTS.tts.layers.xtts.trainer.gpt_trainer"
PATCH = "checkpoint"
# Keys of a GPTTrainer state dict that XTTS itself drops when loading xtts_checkpoint.
_XTTS_IGNORED = ("torch_mel_spectrogram_style_encoder", "torch_mel_spectrogram_dvae", "dvae")


def _is_local(path: Any) -> bool:
    text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    return "://" not in text or text.startswith("file://")


def _local(path: Any) -> Path:
    text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    return Path(text[len("file://"):] if text.startswith("file://") else text)


def make_restore_model(original: Callable[[Any], None]) -> Callable[[Any], None]:
    """``Trainer.restore_model`` through :func:`load_checkpoint`."""

    @functools.wraps(original)
    def restore_model(self: Any) -> None:
        path = self.args.restore_path
        if not _is_local(path):
            return original(self)
        verb = "Continuing" if self.continue_run else "Restoring"
        info("training-patches: %s from %s with the vocabulary-aware loader", verb, path)
        if self.continue_run:
            scaler = self.scaler if self.use_amp_scaler else None
            report = load_checkpoint(_local(path), self.model, self.optimizer, self.scheduler,
                                     scaler, policy=_options.current().resume_policy,
                                     restore_rng=False)
            if report.policy == "remap":
                # as upstream: +1 so that a restored model is not checkpointed at once
                self.total_steps_done = report.step + 1
                self.epochs_done = report.epoch or 0
            else:
                self.total_steps_done = 0
                self.epochs_done = 0
        else:
            # restore_path alone: weights only, fresh optimizer/scheduler/scaler (upstream).
            load_checkpoint(_local(path), self.model, restore_rng=False)
            self.total_steps_done = 0
            self.epochs_done = 0
            self.reset_lr()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    restore_model._training_patch = PATCH  # type: ignore[attr-defined]
    return restore_model


def make_save_fsspec(original: Callable[..., None]) -> Callable[..., None]:
    """``trainer.io.save_fsspec`` that writes local files atomically."""

    @functools.wraps(original)
    def save_fsspec(state: Any, path: Any, **kwargs: Any) -> None:
        if not _is_local(path):
            return original(state, path, **kwargs)
        atomic_torch_save(state, _local(path), **kwargs)

    save_fsspec._training_patch = PATCH  # type: ignore[attr-defined]
    return save_fsspec


def make_get_last_checkpoint(original: Callable[[Any], tuple[str, str]]
                             ) -> Callable[[Any], tuple[str, str]]:
    """``get_last_checkpoint`` that passes over torn or damaged newest files."""

    @functools.wraps(original)
    def get_last_checkpoint(path: Any) -> tuple[str, str]:
        last, best = original(path)
        if not _is_local(path):
            return last, best
        problem = check_file(_local(last), verify_hash=False)
        if problem is None:
            return last, best
        folder = _local(path)
        candidates = sorted(
            (p for p in folder.glob("*.pth") if p.name.startswith(("checkpoint_", "best_model_"))),
            key=lambda p: int(p.stem.rsplit("_", 1)[-1]) if p.stem.rsplit("_", 1)[-1].isdigit()
            else -1, reverse=True)
        for candidate in candidates:
            if check_file(candidate, verify_hash=False) is None:
                logger.warning(
                    "training-patches: %s %s; continuing from %s instead (the damaged file is "
                    "left on disk)", last, problem, candidate)
                if check_file(_local(best), verify_hash=False) is not None:
                    best = str(candidate)
                return str(candidate), best
        raise CheckpointError(
            f"training-patches: cannot continue the run in {folder}: the newest checkpoint "
            f"{last} {problem}, and no other checkpoint_*/best_model_* file there is complete. "
            f"Nothing was deleted; restore a copy of a checkpoint into that folder or start a "
            f"new run with restore_path pointing at a good model.")

    get_last_checkpoint._training_patch = PATCH  # type: ignore[attr-defined]
    return get_last_checkpoint


def _xtts_state_filter(key: str) -> bool:
    return key.split(".")[0] not in _XTTS_IGNORED


def make_gpt_trainer_load_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
    """``GPTTrainer.load_checkpoint`` (``xtts_checkpoint``) through :func:`load_checkpoint`."""

    @functools.wraps(original)
    def gpt_trainer_load_checkpoint(self: Any, config: Any, checkpoint_path: Any, *,
                                    eval: bool = False, strict: bool = True,  # noqa: A002
                                    **kwargs: Any) -> Any:
        if not _is_local(checkpoint_path) or not _local(checkpoint_path).is_file():
            return original(self, config, checkpoint_path, eval=eval, strict=strict, **kwargs)
        # XTTS drops the DVAE and mel-spectrogram keys of GPTTrainer checkpoints and loads
        # into self.xtts; the loader aligns the "xtts." prefix by itself.
        load_checkpoint(_local(checkpoint_path), self.xtts, strict=strict, restore_rng=False,
                        key_filter=_xtts_state_filter)
        if eval:
            self.xtts.gpt.init_gpt_for_inference(kv_cache=self.args.kv_cache, use_deepspeed=False)
            self.eval()
        return None

    gpt_trainer_load_checkpoint._training_patch = PATCH  # type: ignore[attr-defined]
    return gpt_trainer_load_checkpoint


def load_gpt_checkpoint(gpt_trainer: Any, path: str | os.PathLike[str], *,
                        freeze: bool = True) -> Any:
    """What ``GPTTrainer.__init__`` does with ``gpt_checkpoint``, through the loader.

    Accepts a bare GPT state dict or a coqui Trainer checkpoint (keys ``xtts.gpt.*``);
    a grown vocabulary is mean-resized (not ``torch.randn``). Returns the LoadReport.
    """
    def gpt_keys(key: str) -> bool:
        # a coqui Trainer checkpoint holds the whole GPTTrainer: keep xtts.gpt.* only
        return key.startswith("xtts.gpt.") or not key.startswith(("xtts.", *_XTTS_IGNORED))

    return load_checkpoint(path, gpt_trainer.xtts.gpt, restore_rng=False, freeze=freeze,
                           strict=True, key_filter=gpt_keys)


def make_gpt_trainer_init(original: Callable[..., None]) -> Callable[..., None]:
    """``GPTTrainer.__init__`` that loads ``gpt_checkpoint`` with :func:`load_gpt_checkpoint`."""

    @functools.wraps(original)
    def __init__(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        model_args = getattr(config, "model_args", None)
        path = getattr(model_args, "gpt_checkpoint", "") if model_args is not None else ""
        if not path or not _is_local(path):
            return original(self, config, *args, **kwargs)
        model_args.gpt_checkpoint = ""  # coqui would load it and pad new rows with randn
        try:
            original(self, config, *args, **kwargs)
        finally:
            model_args.gpt_checkpoint = path
        report = load_gpt_checkpoint(self, _local(path))
        info("gpt_checkpoint loaded through training-patches: %s", report.summary())
        return None
    return __init__


def _describe(opts: Any) -> str:
    return (f"vocabulary-aware coqui restore (policy {opts.resume_policy}), atomic coqui saves, "
            f"continue from the newest valid checkpoint")


def sites() -> tuple[Site, ...]:
    return (
        Site(TRAINER, "Trainer.restore_model", make_restore_model),
        Site(TRAINER, "get_last_checkpoint", make_get_last_checkpoint),
        Site(IO, "save_fsspec", make_save_fsspec),
        Site(GPT_TRAINER, "GPTTrainer.load_checkpoint", make_gpt_trainer_load_checkpoint),
        Site(GPT_TRAINER, "GPTTrainer.__init__", make_gpt_trainer_init),
    )


SPEC = register(PatchSpec(name=PATCH, describe=_describe, sites=sites()))
