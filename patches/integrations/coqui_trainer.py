"""Integration ``coqui_trainer``: coqui-tts-trainer (package ``trainer``, 0.4).

Sites of ``grad_scaler``, ``nan_guard`` (under coqui's DDP, which keeps only
``ddp_model.module``, the training forward goes through the kept wrapper), ``oom_guard``,
``checkpoint`` (:mod:`.coqui_checkpoint`, :mod:`.coqui_interrupt`) and ``learning``
(:mod:`.coqui_learning`); each site's ``lost=`` says what it prevents. The run folder is known
from the Trainer's log file (:func:`output_dir_from_logging`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import re
import weakref
from typing import Any

import torch

from .. import _api, _run, nan_guard, oom_guard
from .._log import logger
from .._registry import Integration, Site, active, register_integration
from ..grad_scaler import SafeGradScaler
from . import coqui_checkpoint, coqui_interrupt, coqui_learning

NAME = "coqui_trainer"
DISTRIBUTION = "coqui-tts-trainer"
SUPPORTED = ">=0.3,<0.5"
MODULE = "trainer.trainer"


def output_dir_from_logging() -> str | None:
    """The newest coqui Trainer's output folder, where its ``trainer_N_log.txt`` is written:
    known once the Trainer is built, in DataLoader workers too (they inherit the handlers)."""
    for handler in reversed(logging.getLogger("trainer").handlers):
        path = getattr(handler, "baseFilename", "")
        if isinstance(handler, logging.FileHandler) and re.search(r"trainer_\d+_log\.txt$", path):
            return os.path.dirname(path)
    return None


def scaler_factory(original: Any) -> Any:
    """The trainer's ``GradScaler`` binding with SafeGradScaler in place of torch's class."""
    if isinstance(original, functools.partial):
        return functools.partial(SafeGradScaler, *original.args, **original.keywords)
    return functools.partial(SafeGradScaler, device="cuda")


# -- DDP: the training forward through the wrapper coqui builds and drops ----------------
# The DistributedDataParallel coqui built for each model; it must outlive Trainer.__init__
# (its reducer holds the gradient hooks).
_ddp_of: "weakref.WeakKeyDictionary[torch.nn.Module, Any]" = weakref.WeakKeyDictionary()
_DDP_LOST = ("under coqui's DDP gradients are never all-reduced: each rank trains its own copy "
             "and the ranks drift apart")
_SIGNAL_LOST = "SIGTERM (a cloud machine stopping) or SIGHUP kills a coqui run with no checkpoint"


def make_ddp(original: Any) -> Any:
    """coqui's ``DDP_th(model, ...)``, remembering the wrapper for :func:`make_model_train_step`."""
    @functools.wraps(original)
    def DDP_th(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        # XTTS's GPTTrainer holds trainable parameters its loss never uses (the HiFi-GAN
        # decoder: 472 of 562 tensors): DDP must be told, or its second step raises.
        kwargs.setdefault("find_unused_parameters", True)
        wrapper = original(module, *args, **kwargs)
        _ddp_of[module] = wrapper
        return wrapper
    return DDP_th


def make_model_train_step(original: Any) -> Any:
    @functools.wraps(original)
    def _model_train_step(self: Any, batch: Any, criterion: Any,
                          optimizer_idx: Any = None) -> Any:
        model = self._get_model()
        wrapper = _ddp_of.get(model)
        # Not while the guard replays a bad batch on this rank alone: a DDP backward there
        # would start an all-reduce the other ranks never join.
        if wrapper is None or not torch.is_grad_enabled() or nan_guard.replaying():
            return original(self, batch, criterion, optimizer_idx)
        args = [batch, criterion] + ([] if optimizer_idx is None else [optimizer_idx])

        # DDP calls module(*inputs): for that one call the module's forward is train_step.
        # The class's own forward is back before train_step runs (it may call self.forward).
        def redirected(*inputs: Any, **kwargs: Any) -> Any:
            model.__dict__.pop("forward", None)
            return model.train_step(*inputs, **kwargs)
        model.forward = redirected
        try:
            return wrapper(*args)
        finally:
            model.__dict__.pop("forward", None)
    return _model_train_step


# -- NaN guard: what the Trainer's step hands the guard ---------------------------------

def make_compute_loss(original: Any) -> Any:
    watched: set[int] = set()

    @functools.wraps(original)
    def _compute_loss(self: Any, batch: Any, criterion: Any, optimizer_idx: Any) -> Any:
        _run.set_trainer_dir(getattr(self, "output_path", None))
        _run.set_batch(batch, getattr(self, "total_steps_done", None))
        nan_guard.expect_accumulation(int(getattr(self, "grad_accum_steps", 1) or 1))
        if id(self.model) not in watched:
            watched.add(id(self.model))
            nan_guard.watch(self.model)

        def rerun() -> Any:
            return original(self, batch, criterion, optimizer_idx)[1]["loss"]
        nan_guard.set_replay(lambda: nan_guard.find_nonfinite_source(self.model, rerun))
        outputs, loss_dict = original(self, batch, criterion, optimizer_idx)
        loss = loss_dict.get("loss") if isinstance(loss_dict, dict) else None
        if isinstance(loss, torch.Tensor):
            nan_guard.observe_loss(loss)
        return outputs, loss_dict
    return _compute_loss


def make_detach_loss_dict(original: Any) -> Any:
    @functools.wraps(original)
    def detach_loss_dict(self: Any, loss_dict: Any, **kwargs: Any) -> Any:
        detached = original(self, loss_dict, **kwargs)
        bad = [k for k, v in detached.items()
               if isinstance(v, float) and not math.isfinite(v)]
        if bad:
            # Keep NaN out of the Trainer's running averages: they would read NaN for good.
            logger.warning("nan_guard: trainer step %s: non-finite %s; left out of the "
                           "Trainer's running averages (what happened to the step is logged "
                           "by nan_guard)",
                           getattr(self, "total_steps_done", "?"),
                           ", ".join(f"{k}={detached[k]}" for k in bad))
            for key in bad:
                del detached[key]
        return detached
    return detach_loss_dict


# -- the one wrapper of each Trainer method that several patches want ---------------------

def make_train_step(original: Any) -> Any:
    """``Trainer.train_step`` for ``oom_guard``, ``checkpoint`` and ``nan_guard``, each part
    run while its patch is applied (coqui's epoch loop skips a step returning no outputs)."""
    @functools.wraps(original)
    def train_step(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        skip_oom = active("oom_guard")
        try:
            with contextlib.ExitStack() as parts:
                if active("checkpoint"):
                    parts.enter_context(coqui_interrupt.uninterrupted(self, keep_step=True))
                result = original(self, batch, *args, **kwargs)
                if active("nan_guard"):
                    _plot_counters(self)
        except oom_guard.OOM_ERRORS as exc:
            if not skip_oom:
                raise
            optimizers = self.optimizer if isinstance(self.optimizer, list) else [self.optimizer]
            audio = getattr(getattr(self, "config", None), "audio", None)
            oom_guard.on_oom(exc, batch, [o for o in optimizers if o is not None],
                             step=getattr(self, "total_steps_done", None),
                             sample_rate=getattr(audio, "sample_rate", None))
            return None, None
        if skip_oom:
            oom_guard.on_success()
        return result
    return train_step


def _plot_counters(trainer: Any) -> None:
    step = getattr(trainer, "total_steps_done", 1) - 1
    plot_step = getattr(getattr(trainer, "config", None), "plot_step", 0) or 0
    if plot_step and step % plot_step == 0 and getattr(trainer.args, "rank", 0) == 0:
        scalars = {f"{patch}_{name}": float(value)
                   for patch, counts in _api.stats().items()
                   for name, value in counts.items()}
        trainer.dashboard_logger.add_scalars("TrainingPatches", scalars, step)


def make_fit(original: Any) -> Any:
    """``Trainer.fit`` for ``learning`` and ``checkpoint``, each part run while its patch is
    applied."""
    @functools.wraps(original)
    def fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        if active("learning"):
            coqui_learning.say_if_unmeasured(self)
        with contextlib.ExitStack() as parts:
            if active("checkpoint"):
                parts.enter_context(coqui_interrupt.interruptible_run(self))
            return original(self, *args, **kwargs)
    return fit


def make_remove_experiment_folder(original: Any) -> Any:
    @functools.wraps(original)
    def remove_experiment_folder(experiment_path: Any) -> None:
        folder = str(experiment_path)
        kept = _run.own_files_in(folder)  # each rank's files too
        has_checkpoint = os.path.isdir(folder) and any(
            name.endswith(".pth") for name in os.listdir(folder))
        if kept and not has_checkpoint:  # coqui would delete it, and our reports with it
            logger.warning("training-patches: kept the run folder %s (coqui removes a folder "
                           "without checkpoints on error) because it holds %s", folder,
                           ", ".join(kept))
            return None
        return original(experiment_path)
    return remove_experiment_folder


_run.register_dir_provider(output_dir_from_logging)

INTEGRATION = register_integration(Integration(
    name=NAME,
    distribution=DISTRIBUTION,
    supported=SUPPORTED,
    module="trainer",
    describe="SafeGradScaler in the Trainer, NaN losses seen before backward, DDP "
             "gradients all-reduced, atomic saves and vocabulary-aware restore",
    sites=(
        Site(MODULE, "GradScaler", scaler_factory, patch="grad_scaler",
             lost="the coqui Trainer builds torch's GradScaler (initial scale 65536, no skip "
                  "counters, no loss-scale floor)"),
        Site(MODULE, "Trainer._compute_loss", make_compute_loss, patch="nan_guard",
             lost="a NaN loss of a coqui batch is not seen before backward, and events carry "
                  "no sample ids or trainer step"),
        Site(MODULE, "Trainer.detach_loss_dict", make_detach_loss_dict, patch="nan_guard",
             lost="a NaN loss stays in the coqui Trainer's running averages"),
        Site(MODULE, "Trainer.train_step", make_train_step,
             patch=("nan_guard", "checkpoint", "oom_guard"),
             lost={"nan_guard": "the patches' counters do not reach TensorBoard",
                   "checkpoint": "a signal stops a coqui step half-way (weights "
                                 "half-updated), and the checkpoint written on a signal "
                                 "continues one step off, with other draws",
                   "oom_guard": "one batch that runs out of GPU memory ends the run"}),
        Site(MODULE, "DDP_th", make_ddp, patch="nan_guard", lost=_DDP_LOST),
        Site(MODULE, "Trainer._model_train_step", make_model_train_step, patch="nan_guard",
             lost=_DDP_LOST),
        Site(MODULE, "remove_experiment_folder", make_remove_experiment_folder, patch="nan_guard",
             lost="coqui deletes a failed run's folder, with the reports that explain it"),
        Site(MODULE, "Trainer.restore_model", coqui_checkpoint.make_restore_model,
             patch="checkpoint", lost="restore_path/continue_path drop every trained row when "
             "the vocabulary grew, and restore a scheduler that no longer matches the optimizer"),
        Site(MODULE, "get_last_checkpoint", coqui_checkpoint.make_get_last_checkpoint,
             patch="checkpoint", lost="continue_path resumes from the newest file name even "
             "when it is torn"),
        Site(MODULE, "Trainer.fit", make_fit, patch=("checkpoint", "learning"),
             lost={"checkpoint": _SIGNAL_LOST + ", and Ctrl-C ends it with os._exit(130), "
                                 "workers left behind",
                   "learning": "a coqui run without evaluations is not told that its "
                               "reading gap goes unmeasured"}),
        Site(MODULE, "Trainer._fit", coqui_interrupt.make_inner_fit, patch="checkpoint",
             lost=_SIGNAL_LOST),
        Site(MODULE, "Trainer.save_best_model", coqui_interrupt.make_uninterrupted,
             patch="checkpoint", lost="a signal stops the epoch's best-model save half-way"),
        Site(MODULE, "Trainer.save_checkpoint", coqui_interrupt.make_save_checkpoint,
             patch="checkpoint", lost="an interrupted coqui run saves again a step it has "
             "already saved"),
        Site(MODULE, "get_experiment_folder_path", coqui_checkpoint.make_experiment_folder,
             patch="checkpoint", lost="two coqui runs started in the same minute into one output "
             "folder share a run folder and overwrite each other's checkpoints"),
        Site(MODULE, "copy_model_files", coqui_checkpoint.make_copy_model_files,
             patch="checkpoint", lost="a second run continuing a run folder in use overwrites "
             "its checkpoints"),
        Site(coqui_checkpoint.IO, "save_fsspec", coqui_checkpoint.make_save_fsspec,
             patch="checkpoint", lost="coqui checkpoints are written in place, not atomically: "
             "a kill during a save leaves a torn file"),
        Site(MODULE, "Trainer.eval_step", coqui_learning.make_eval_step, patch="learning",
             lost="the reading gap has no probe: nothing tells whether XTTS reads its text"),
        Site(MODULE, "Trainer.eval_epoch", coqui_learning.make_eval_epoch, patch="learning",
             lost="the reading gap is not measured at the coqui Trainer's evaluations"),
    ),
    reset=coqui_learning.reset,
))
