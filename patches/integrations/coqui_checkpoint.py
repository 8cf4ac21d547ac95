"""The coqui Trainer's checkpoint sites (the ``checkpoint`` patch, declared by
:mod:`.coqui_trainer`, whose ``lost=`` texts say what each prevents): ``restore_model``
through :func:`patches.checkpoint.load_checkpoint` (``continue_path`` restores optimizer,
scheduler and scaler as one set, by ``TRAINING_PATCHES_RESUME_POLICY``, and the train
loader's data position), atomic local saves, a torn newest file passed over, one run per run
folder. XTTS's own sites are in :mod:`.xtts_gpt`. The user's view:
TRAINING_PATCHES_README.md, "With the coqui Trainer / XTTS".
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


def is_local(path: Any) -> bool:
    text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    return "://" not in text or text.startswith("file://")


def local_path(path: Any) -> Path:
    text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    return Path(text[len("file://"):] if text.startswith("file://") else text)


def model_tokenizer(config: Any, model: Any = None) -> Any:
    """The tokenizer the model was built with, for the loader's spelled new rows: the model's
    own (under ``continue_path`` the config is the run folder's, naming the vocabulary before
    a growth), else the local ``model_args.tokenizer_file``, else None."""
    model = getattr(model, "module", model)  # under DDP
    own = getattr(getattr(model, "xtts", None), "tokenizer", None)
    if getattr(own, "tokenizer", None) is not None:
        return own
    args = getattr(config, "model_args", None)
    path = (args.get("tokenizer_file", "") if isinstance(args, dict)
            else getattr(args, "tokenizer_file", ""))
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
        tokenizer = model_tokenizer(getattr(self, "config", None), self.model)
        if self.continue_run:
            report = load_checkpoint(local_path(path), self.model, self.optimizer, self.scheduler,
                                     self.scaler if self.use_amp_scaler else None,
                                     policy=_options.current().resume_policy,
                                     loader=_train_loader(self), tokenizer=tokenizer)
            if "data_ranks" in report.checkpoint and getattr(self, "use_accelerate", False):
                logger.warning(
                    "training-patches: %s holds the train loader's data position, and under "
                    "accelerate the coqui Trainer wraps its loader after the restore: the epoch "
                    "starts again from its beginning (batches already trained on come again)",
                    path)
            if report.policy == "remap":
                # coqui saves inside a step, before counting it: a file's step N holds N + 1
                self.total_steps_done = report.step + 1
                self.epochs_done = report.epoch or 0
                info("training-patches: continue_path: %s holds step %d in coqui's count; the "
                     "run continues at trainer step %d", path, report.step,
                     self.total_steps_done)
            else:
                self.total_steps_done = self.epochs_done = 0
            # The scheduler's step count is not compared: coqui counts batches under
            # accumulation, holds the scheduler on skipped steps, and (0.4) never steps a
            # per-epoch scheduler of a single optimizer.
            resume_check.expect_resume(self.total_steps_done, source="coqui continue_path")
        else:
            # restore_path alone: weights only, fresh optimizer/scheduler/scaler (upstream).
            report = load_checkpoint(local_path(path), self.model, restore_rng=False,
                                     resume_step=False, tokenizer=tokenizer)
            warn_weights_only(
                report, "restore_path loads the model weights only, as upstream coqui does",
                "To resume that run with them, pass continue_path=<its run folder> instead; to "
                "fine-tune from its weights on purpose, nothing needs to change.")
            self.total_steps_done = self.epochs_done = 0
            self.reset_lr()
            resume_check.expect_resume(0, scheduler_step=0, source="coqui restore_path")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    return restore_model


def _train_loader(trainer: Any) -> Any:
    """The loader a continued run will train on, made now (as ``train_epoch`` would) so that
    the load can set its position; None where that cannot be."""
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
    """What a checkpoint written between two steps needs of the moment the last one ended (a
    signal can come while the next batch is read): the RNG (one process), the batches read."""

    rng: dict[str, Any] | None
    yielded: int | None


def after_step(trainer: Any) -> AfterStep:
    """:class:`AfterStep` of ``trainer`` now (read at the end of each ``train_step``)."""
    return AfterStep(rng=capture_rng_state() if _dist.world_size() <= 1 else None,
                     yielded=data_position.yielded(getattr(trainer, "train_loader", None)))


_saving: list[tuple[Any, AfterStep | None]] = []  # the Trainer whose save_checkpoint runs


@contextlib.contextmanager
def saving_from(trainer: Any, between_steps: AfterStep | None = None):
    """While ``trainer`` saves, :func:`make_save_fsspec` adds its loader's data position.
    ``between_steps``: a save after the last step ended (coqui's own are inside a step): its
    ``step`` is one less than the steps done, as coqui counts (``continue_path`` adds 1)."""
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
        position = data_position.position_of(loader, yielded=getattr(between, "yielded", None))
    except ValueError as exc:
        info("training-patches: the coqui checkpoint is saved without the data position: %s",
             str(exc)[:300])
        return {**state, **extra}
    extra["data_ranks"] = [position]
    if "rng" not in state and _dist.world_size() <= 1:
        # One process: its RNG too (XTTS's dataset picks samples with ``random``); under DDP
        # only rank 0 saves, and its RNG is not every rank's.
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

    return save_fsspec


def make_experiment_folder(original: Callable[[Any, str], Path]) -> Callable[[Any, str], Path]:
    """``get_experiment_folder_path`` that never names a folder another run has (upstream's
    name is by the minute): the first free of ``<name>``, ``<name>-2``, ..., claimed as it is
    made; ranks of one job keep upstream's shared name."""

    @functools.wraps(original)
    def get_experiment_folder_path(root_path: Any, model_name: str) -> Path:
        path = original(root_path, model_name)
        # under trainer.distribute (which sets RANK) or torchrun every rank names one folder
        if not is_local(path) or "RANK" in os.environ or _dist.world_size() > 1:
            return path
        return _runlock.claim_new_folder(local_path(path))

    return get_experiment_folder_path


def make_copy_model_files(original: Callable[..., None]) -> Callable[..., None]:
    """``copy_model_files``, the Trainer's first write into its run folder, after the folder
    is locked for this process (:func:`patches._runlock.lock_folder`)."""

    @functools.wraps(original)
    def copy_model_files(config: Any, out_path: Any, *args: Any, **kwargs: Any) -> None:
        if is_local(out_path) and _dist.rank() == 0:
            _runlock.lock_folder(local_path(out_path))
        return original(config, out_path, *args, **kwargs)

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

    return get_last_checkpoint
