"""The coqui Trainer's checkpoint sites (the ``checkpoint`` patch, declared by
:mod:`.coqui_trainer`): restore, save and continue through training-patches.

Sites (coqui-tts-trainer 0.4), all reversible through the registry:

- ``trainer.trainer.Trainer.restore_model``: ``restore_path`` and ``continue_path``
  load with :func:`patches.checkpoint.load_checkpoint`. Upstream falls back to a
  partial load that drops every tensor whose shape changed (74 -> 82 tokens: 0 of 74
  trained rows kept) and restores scheduler and scaler even when the optimizer did not
  load. Here a grown vocabulary is resized (rows kept, new rows by
  :mod:`patches.row_init`'s rules, spelled with the config's ``tokenizer_file``, the
  base rows frozen), any other mismatch is an error, and ``continue_path`` restores
  optimizer, scheduler and scaler as one set (``TRAINING_PATCHES_RESUME_POLICY``:
  ``remap``, or ``reset`` to start all three fresh). ``restore_path`` alone loads the
  weights only, as upstream does.
- ``trainer.io.save_fsspec``: every coqui checkpoint (``checkpoint_N.pth``,
  ``best_model_N.pth``) is written atomically (temporary file in the same folder,
  fsync, ``os.replace``). Remote (fsspec URL) paths go to the original. A checkpoint
  written by ``Trainer.save_checkpoint`` also holds the train loader's data position
  (:mod:`patches.checkpoint.data_position`), and ``continue_path`` continues the epoch
  at the batch where it stopped instead of starting it again.
- ``trainer.trainer.get_last_checkpoint``: ``continue_path`` resumes from the newest
  checkpoint that validates; upstream trusts the newest name, torn or not.

XTTS's own checkpoint sites (``gpt_checkpoint``, ``xtts_checkpoint``) are in
:mod:`.xtts_gpt`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from pathlib import Path
from typing import Any, Callable

import torch

from .. import _dist, _options, _runlock, resume_check
from .._log import info, logger
from ..checkpoint import CheckpointError, data_position
from ..checkpoint.rng import capture_rng_state

IO = "trainer.io"
PATCH = "checkpoint"


def is_local(path: Any) -> bool:
    text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    return "://" not in text or text.startswith("file://")


def local_path(path: Any) -> Path:
    text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    return Path(text[len("file://"):] if text.startswith("file://") else text)


def model_tokenizer(config: Any, model: Any = None) -> Any:
    """The tokenizer the model was built with, for the loader's spelled new rows
    (``spelling``, ``romanized``), which checks it against the model's rows: the
    model's own (GPTTrainer's ``xtts.tokenizer``, loaded) when ``model`` has one (under
    ``continue_path`` the Trainer's config is the run folder's, which names the vocabulary
    before a growth), else the local file a coqui config names (``model_args.tokenizer_file``,
    XTTS); None when it names none that exists here."""
    model = getattr(model, "module", model)  # under DDP
    own = getattr(getattr(model, "xtts", None), "tokenizer", None)
    if getattr(own, "tokenizer", None) is not None:
        return own
    args = getattr(config, "model_args", None)
    path = getattr(args, "tokenizer_file", "") if args is not None else ""
    if isinstance(args, dict):
        path = args.get("tokenizer_file", "")
    if not path or not is_local(path) or not local_path(path).is_file():
        return None
    return str(local_path(path))


def make_restore_model(original: Callable[[Any], None]) -> Callable[[Any], None]:
    """``Trainer.restore_model`` through :func:`load_checkpoint`."""

    @functools.wraps(original)
    def restore_model(self: Any) -> None:
        from ..checkpoint.load import load_checkpoint, warn_weights_only  # lazy: heavy (issue 41)

        path = self.args.restore_path
        if not is_local(path):
            return original(self)
        verb = "Continuing" if self.continue_run else "Restoring"
        info("training-patches: %s from %s with the vocabulary-aware loader", verb, path)
        if self.continue_run:
            scaler = self.scaler if self.use_amp_scaler else None
            report = load_checkpoint(local_path(path), self.model, self.optimizer, self.scheduler,
                                     scaler, policy=_options.current().resume_policy,
                                     loader=_train_loader(self),
                                     tokenizer=model_tokenizer(getattr(self, "config", None),
                                                               self.model))
            if "data_ranks" in report.checkpoint and getattr(self, "use_accelerate", False):
                logger.warning(
                    "training-patches: %s holds the train loader's data position, and under "
                    "accelerate the coqui Trainer wraps its loader after the restore: the epoch "
                    "starts again from its beginning (batches already trained on come again)",
                    path)
            if report.policy == "remap":
                # as upstream: +1 so that a restored model is not checkpointed at once
                self.total_steps_done = report.step + 1
                self.epochs_done = report.epoch or 0
                # coqui saves inside a step, before counting it: a file's step N holds N + 1
                # steps (a checkpoint written on a signal is stored the same way)
                info("training-patches: continue_path: %s holds step %d in coqui's count; the "
                     "run continues at trainer step %d", path, report.step,
                     self.total_steps_done)
            else:
                self.total_steps_done = 0
                self.epochs_done = 0
            # The first step checks LR, scheduler and moments; the scheduler's step count is
            # not compared: coqui counts batches under accumulation, holds the scheduler on
            # the scaler's skipped steps, and (0.4) never steps a per-epoch scheduler of a
            # single optimizer (it records optimizer index None, then looks for 0).
            resume_check.expect_resume(self.total_steps_done, source="coqui continue_path")
        else:
            # restore_path alone: weights only, fresh optimizer/scheduler/scaler (upstream).
            report = load_checkpoint(local_path(path), self.model, restore_rng=False,
                                     resume_step=False,
                                     tokenizer=model_tokenizer(getattr(self, "config", None),
                                                               self.model))
            warn_weights_only(
                report, "restore_path loads the model weights only, as upstream coqui does",
                "To resume that run with them, pass continue_path=<its run folder> instead; to "
                "fine-tune from its weights on purpose, nothing needs to change.")
            self.total_steps_done = 0
            self.epochs_done = 0
            self.reset_lr()
            resume_check.expect_resume(0, scheduler_step=0, source="coqui restore_path")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    restore_model._training_patch = PATCH  # type: ignore[attr-defined]
    return restore_model


def _train_loader(trainer: Any) -> Any:
    """The loader a continued run will train on, made now (``train_epoch`` would make the
    same one later) so that the load can set its position; None where that cannot be."""
    if getattr(trainer, "use_accelerate", False):
        return None  # accelerate prepares (wraps) the loader after the restore
    if getattr(trainer, "train_loader", None) is None:
        try:
            trainer.train_loader = trainer.get_train_dataloader(trainer.train_samples,
                                                                verbose=False)
        except Exception as exc:  # noqa: BLE001 - train_epoch makes it as upstream does
            info("training-patches: the train loader could not be made at the restore (%s: "
                 "%s); the data position is not restored", type(exc).__name__, str(exc)[:200])
            return None
    return trainer.train_loader


@dataclasses.dataclass(frozen=True)
class AfterStep:
    """What a checkpoint written between two steps needs of the moment the last step ended:
    the RNG (one process) and the batches the train loader had handed out. A signal can
    come while the next batch is read, after its samples drew from ``random``."""

    rng: dict[str, Any] | None
    yielded: int | None


def after_step(trainer: Any) -> AfterStep:
    """:class:`AfterStep` of ``trainer`` now (read at the end of each ``train_step``)."""
    return AfterStep(rng=capture_rng_state() if _dist.world_size() <= 1 else None,
                     yielded=data_position.yielded(getattr(trainer, "train_loader", None)))


_saving: list[tuple[Any, AfterStep | None]] = []  # the Trainer whose save_checkpoint runs


@contextlib.contextmanager
def saving_from(trainer: Any, between_steps: AfterStep | None = None):
    """While ``trainer`` saves a checkpoint: :func:`make_save_fsspec` adds its train
    loader's data position to what it writes. ``between_steps``: the save is not coqui's
    own (which runs inside a step, before the step is counted) but one after the last step
    ended: the file holds the state of that moment, and its ``step`` is one less than the
    steps done, as coqui's own saves count it (``continue_path`` resumes at ``step + 1``)."""
    _saving.append((trainer, between_steps))
    try:
        yield
    finally:
        _saving.pop()


def _with_data_position(state: Any) -> Any:
    """``state`` with this process's train loader position (``data_ranks``), when a Trainer
    is saving a checkpoint and its loader's position is known."""
    trainer, between = _saving[-1] if _saving else (None, None)
    loader = getattr(trainer, "train_loader", None)
    if loader is None or not isinstance(state, dict) or "step" not in state:
        return state
    extra: dict[str, Any] = {}
    if between is not None:
        extra["step"] = max(int(state["step"]) - 1, 0)
    try:
        position = data_position.position_of(
            loader, yielded=between.yielded if between is not None else None)
    except ValueError as exc:
        info("training-patches: the coqui checkpoint is saved without the data position: %s",
             str(exc)[:300])
        return {**state, **extra}
    extra["data_ranks"] = [position]
    if "rng" not in state and _dist.world_size() <= 1:
        # One process: its RNG too, which continue_path restores, so that what the samples
        # draw when they are read (XTTS's dataset picks them with ``random``) continues as
        # in the stopped run. (Under DDP only rank 0 saves: its RNG is not every rank's.)
        extra["rng"] = (between.rng if between is not None and between.rng is not None
                        else capture_rng_state())
    return {**state, **extra}


def make_save_fsspec(original: Callable[..., None]) -> Callable[..., None]:
    """``trainer.io.save_fsspec`` that writes local files atomically (with the data
    position during ``Trainer.save_checkpoint``)."""

    @functools.wraps(original)
    def save_fsspec(state: Any, path: Any, **kwargs: Any) -> None:
        if not is_local(path):
            return original(state, path, **kwargs)
        from ..checkpoint.atomic import atomic_torch_save  # lazy: heavy (issue 41)

        atomic_torch_save(_with_data_position(state), local_path(path), **kwargs)

    save_fsspec._training_patch = PATCH  # type: ignore[attr-defined]
    return save_fsspec


def _one_process() -> bool:
    """Not one rank of several: under ``trainer.distribute`` (which sets ``RANK``) or
    torchrun every rank must name the same run folder."""
    return "RANK" not in os.environ and _dist.world_size() <= 1


def make_experiment_folder(original: Callable[[Any, str], Path]) -> Callable[[Any, str], Path]:
    """``get_experiment_folder_path`` that never names a folder another run has.

    Upstream names a new run ``<run_name>-<month-day-year_hour+minute>-<commit>``: two runs
    started in the same minute into one output folder shared it, each overwriting the
    other's checkpoints and config.json. Here the name is claimed as it is made (the first
    free of ``<name>``, ``<name>-2``, ...); ranks of one job keep upstream's shared name."""

    @functools.wraps(original)
    def get_experiment_folder_path(root_path: Any, model_name: str) -> Path:
        path = original(root_path, model_name)
        if not is_local(path) or not _one_process():
            return path
        return _runlock.claim_new_folder(local_path(path))

    get_experiment_folder_path._training_patch = PATCH  # type: ignore[attr-defined]
    return get_experiment_folder_path


def make_copy_model_files(original: Callable[..., None]) -> Callable[..., None]:
    """``copy_model_files``, the Trainer's first write into its run folder (new or
    continued), after the folder is locked for this process: a second run continuing a
    folder in use is :class:`patches.RunFolderInUse`, before it writes anything there."""

    @functools.wraps(original)
    def copy_model_files(config: Any, out_path: Any, *args: Any, **kwargs: Any) -> None:
        if is_local(out_path) and _dist.rank() == 0:
            _runlock.lock_folder(local_path(out_path))
        return original(config, out_path, *args, **kwargs)

    copy_model_files._training_patch = PATCH  # type: ignore[attr-defined]
    return copy_model_files


def make_get_last_checkpoint(original: Callable[[Any], tuple[str, str]]
                             ) -> Callable[[Any], tuple[str, str]]:
    """``get_last_checkpoint`` that passes over torn or damaged newest files."""

    @functools.wraps(original)
    def get_last_checkpoint(path: Any) -> tuple[str, str]:
        last, best = original(path)
        if not is_local(path):
            return last, best
        from ..checkpoint.reading import check_file  # lazy: heavy (issue 41)

        problem = check_file(local_path(last))
        if problem is None:
            return last, best
        folder = local_path(path)
        candidates = sorted(
            (p for p in folder.glob("*.pth") if p.name.startswith(("checkpoint_", "best_model_"))),
            key=lambda p: int(p.stem.rsplit("_", 1)[-1]) if p.stem.rsplit("_", 1)[-1].isdigit()
            else -1, reverse=True)
        for candidate in candidates:
            if check_file(candidate) is None:
                logger.warning(
                    "training-patches: %s %s; continuing from %s instead (the damaged file is "
                    "left on disk)", last, problem, candidate)
                if check_file(local_path(best)) is not None:
                    best = str(candidate)
                return str(candidate), best
        raise CheckpointError(
            f"training-patches: cannot continue the run in {folder}: the newest checkpoint "
            f"{last} {problem}, and no other checkpoint_*/best_model_* file there is complete. "
            f"Nothing was deleted; restore a copy of a checkpoint into that folder or start a "
            f"new run with restore_path pointing at a good model.")

    get_last_checkpoint._training_patch = PATCH  # type: ignore[attr-defined]
    return get_last_checkpoint
