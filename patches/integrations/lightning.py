"""Integration ``lightning``: Lightning 2.6 (``lightning.pytorch.Trainer``).

Sites on the Trainer: records in ``Trainer.log_dir`` with ``global_step``; fused skips
recorded at each save and at the end; local checkpoints written atomically beside
themselves; ``fit(ckpt_path=...)`` into a grown vocabulary (:mod:`patches.checkpoint.grown`,
spelled with the module's or datamodule's ``tokenizer``); one run per ``log_dir`` with its
``trainer_runs.jsonl`` (:mod:`.trainers`). :func:`reading_callback`: the reading gap after
each validation (:mod:`patches.learning`).

Design: docs/design/trainers.md
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import _run, learning, nan_guard
from .._registry import Integration, Site, active, register_integration
from . import trainers

if TYPE_CHECKING:  # imported where used: heavy (issue 41)
    from ..checkpoint import grown

NAME = "lightning"
DISTRIBUTION = "lightning"
SUPPORTED = ">=2.6,<2.7"
MODULE = "lightning.pytorch.trainer.trainer"


@functools.cache
def _callback_class() -> type:
    """The Callback that hands the Trainer's step to the records before each batch, and
    records the fused steps' waiting skips at each checkpoint and at the end. Made once, on
    first use, and this module's ``TrainerStep`` (``__getattr__``): ``ddp_spawn`` pickles it."""
    from lightning.pytorch.callbacks import Callback  # lazy: lightning is imported by now

    class TrainerStep(Callback):
        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            _run.current().trainer_step = int(trainer.global_step)

        def on_save_checkpoint(self, *args: Any) -> None:
            nan_guard.settle()

        def on_train_end(self, *args: Any) -> None:
            nan_guard.settle()

    TrainerStep.__module__, TrainerStep.__qualname__ = __name__, "TrainerStep"
    return TrainerStep


@functools.cache
def _reading_class() -> type:
    """The Callback of :func:`reading_callback`, this module's ``ReadingCallback``."""
    from lightning.pytorch.callbacks import Callback  # lazy: the integration never imports it

    class ReadingCallback(Callback):
        """Measures the reading gap after each validation, on global rank 0."""

        def __init__(self, monitor: learning.LearningMonitor) -> None:
            self.monitor = monitor

        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            if trainer.sanity_checking or not trainer.is_global_zero:
                return
            if _run.output_dir() is None:  # beside the Trainer's files, as fit()'s site puts them
                _run.set_trainer_dir(trainer.log_dir or trainer.default_root_dir)
            loss = trainer.callback_metrics.get("val_loss")
            learning.evaluate_once(self.monitor, pl_module, int(trainer.global_step),
                                   eval_loss=None if loss is None else float(loss))

    ReadingCallback.__module__, ReadingCallback.__qualname__ = __name__, "ReadingCallback"
    return ReadingCallback


def reading_callback(monitor: learning.LearningMonitor) -> Any:
    """A Lightning ``Callback`` that measures the reading gap (:mod:`patches.learning`) after
    each validation (not the sanity check), at the Trainer's ``global_step``, with the
    logged ``val_loss`` when there is one::

        monitor = patches.advanced.LearningMonitor(probe, loss_fn)  # loss_fn(module, texts, audios)
        Trainer(..., val_check_interval=500, callbacks=[lightning.reading_callback(monitor)])

    On global rank 0 alone (so not with FSDP or DeepSpeed stage 3's sharded parameters), into
    ``learning_health.jsonl`` in the Trainer's ``log_dir``. A monitor without ``loss_fn`` is a
    TypeError."""
    checked = learning.checked_monitor(monitor, "lightning.reading_callback")
    return _reading_class()(checked)


def __getattr__(name: str) -> Any:
    if name == "TrainerStep":  # pickle's way back to the class, in any process
        return _callback_class()
    if name == "ReadingCallback":
        return _reading_class()
    if name == "RunClaim":
        return _claim_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_fit(original: Any) -> Any:
    """``Trainer.fit`` for two patches, each part run while its patch is applied.
    ``checkpoint``: the Trainer's ``log_dir`` is claimed for this run (on global rank 0, at
    ``on_fit_start``), its start and end recorded there (:class:`.trainers.RunRecord`).
    ``nan_guard``: the patches are told where the Trainer writes and how it counts its
    steps (its callback)."""
    @functools.wraps(original)
    def fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        with contextlib.ExitStack() as parts:
            if active("checkpoint"):
                parts.enter_context(_recorded_run(self))
            if active("nan_guard"):
                try:
                    _run.set_trainer_dir(self.log_dir or self.default_root_dir)
                except Exception:  # noqa: BLE001 - a logger that cannot say: the default stays
                    pass
                if not any(isinstance(c, _callback_class()) for c in self.callbacks):
                    self.callbacks.append(_callback_class()())
            return original(self, *args, **kwargs)
    return fit


NAME_SAID = "Lightning's Trainer"


def _folder(trainer: Any) -> Any:
    try:
        return trainer.log_dir or trainer.default_root_dir
    except Exception:  # noqa: BLE001 - a logger that cannot say: the default folder
        return getattr(trainer, "default_root_dir", None)


def _last_checkpoint(trainer: Any) -> Any:
    callback = getattr(trainer, "checkpoint_callback", None)
    return (getattr(callback, "last_model_path", "") or getattr(callback, "best_model_path", "")
            or None)


_runs: "weakref.WeakKeyDictionary[Any, trainers.RunRecord]" = weakref.WeakKeyDictionary()


@functools.cache
def _claim_class() -> type:
    """The Callback (this module's ``RunClaim``) that claims the Trainer's folder and records
    the run's start at ``on_fit_start``: after the loggers made their folders (a CSVLogger
    deletes the metrics.csv of a version folder that is not empty), before any save."""
    from lightning.pytorch.callbacks import Callback  # lazy: lightning is imported by now

    class RunClaim(Callback):
        def on_fit_start(self, trainer: Any, *args: Any) -> None:
            run = _runs.get(trainer)
            if run is not None:
                run.start(_folder(trainer))

    RunClaim.__module__, RunClaim.__qualname__ = __name__, "RunClaim"
    return RunClaim


def _recorded_run(trainer: Any) -> contextlib.AbstractContextManager[None]:
    """The run's record, started by the :func:`_claim_class` callback; the context records
    the end."""
    run = trainers.RunRecord(
        trainer=NAME, said=NAME_SAID, overwritten="checkpoints and logs",
        step=lambda: int(trainer.global_step), checkpoint=lambda: _last_checkpoint(trainer),
        continue_with="trainer.fit(model, ckpt_path=<that checkpoint>)",
        writes=bool(getattr(trainer, "is_global_zero", True)))
    _runs[trainer] = run
    if not any(isinstance(c, _claim_class()) for c in trainer.callbacks):
        trainer.callbacks.append(_claim_class()())
    return run.ending()


def make_atomic_save(original: Any) -> Any:
    """``_atomic_save(checkpoint, filepath)`` of Lightning's TorchCheckpointIO: a local path
    through the library's atomic writer, a remote one (fsspec URL) to the original."""
    @functools.wraps(original)
    def _atomic_save(checkpoint: Any, filepath: Any) -> None:
        text = str(filepath)
        if "://" in text and not text.startswith("file://"):
            return original(checkpoint, filepath)
        from ..checkpoint.atomic import atomic_torch_save  # lazy: heavy (issue 41)

        atomic_torch_save(checkpoint, Path(text.removeprefix("file://")))
    return _atomic_save


def make_load_model_state_dict(original: Any) -> Any:
    """``Strategy.load_model_state_dict`` that also loads into a LightningModule whose
    vocabulary grew since the save."""
    @functools.wraps(original)
    def load_model_state_dict(self: Any, checkpoint: Mapping[str, Any], strict: bool = True
                              ) -> Any:
        self._training_patches_grown = None
        module = self.lightning_module
        state = checkpoint.get("state_dict") if isinstance(checkpoint, Mapping) else None
        path = getattr(getattr(module, "_trainer", None), "ckpt_path", None)
        if isinstance(state, Mapping) and path and "://" not in str(path):
            from ..checkpoint import grown  # lazy: heavy (issue 41)

            changes = grown.vocabulary_growth(grown.tensor_shapes(state), module)
            if changes:  # read again from the file: the loader validates what it loads
                self._training_patches_grown = grown.load_grown(
                    Path(path), module, set(state), resume=_resume_of(checkpoint, module),
                    strict=strict)
                return None
        return original(self, checkpoint, strict)
    return load_model_state_dict


def _tokenizer_of(module: Any) -> tuple[Any, str]:
    """The ``tokenizer`` of the LightningModule, else of its Trainer's datamodule, as the
    loader reads it, and where; (None, where it looked) when neither has one."""
    trainer = getattr(module, "_trainer", None)
    for owner, said in ((module, f"the LightningModule {type(module).__name__}"),
                        (getattr(trainer, "datamodule", None), "the Trainer's datamodule")):
        held = getattr(owner, "tokenizer", None) if owner is not None else None
        if held is not None:
            found, what = trainers.spelling_tokenizer(held)
            return found, f"{said}'s tokenizer ({what})"
    return None, ("neither the LightningModule nor the Trainer's datamodule has a "
                  "`tokenizer` attribute")


def _resume_of(checkpoint: Mapping[str, Any], module: Any) -> grown.TrainerResume:
    """What Lightning restores itself after the weights, its step and the tokenizer."""
    keys = {"optimizer": "optimizer_states", "scheduler": "lr_schedulers",
            "scaler": "native_amp_scaling_state", "step": "global_step"}
    restores = {part: f"the checkpoint's {key!r}" for part, key in keys.items()
                if checkpoint.get(key) not in (None, [], {})}
    step = checkpoint.get("global_step")
    tokenizer, source = _tokenizer_of(module)
    from ..checkpoint import grown  # lazy: heavy (issue 41)

    return grown.TrainerResume(NAME_SAID, restores, int(step) if isinstance(step, int) else None,
                               tokenizer, source)


def make_load_optimizer_state_dict(original: Any) -> Any:
    """``Strategy.load_optimizer_state_dict`` that grows the loaded moments of the rows
    :func:`make_load_model_state_dict` grew (:func:`.trainers.growing_moments`)."""
    return trainers.growing_moments(original, lambda strategy: strategy.optimizers)


INTEGRATION = register_integration(Integration(
    name=NAME,
    distribution=DISTRIBUTION,
    supported=SUPPORTED,
    module="lightning",
    describe="records in the Trainer's log_dir with its global_step (the step(closure) "
             "decision is the generic guard's); one run per log_dir with its start and end "
             "recorded; checkpoints written atomically beside themselves; fit(ckpt_path=) "
             "into a grown vocabulary",
    sites=(
        Site(MODULE, "Trainer.fit", make_fit, patch=("nan_guard", "checkpoint"),
             lost={"nan_guard": "a Lightning run's records go to ./training_patches, not the "
                                "Trainer's log_dir, and carry no trainer step",
                   "checkpoint": "two Lightning runs into one log_dir overwrite each other's "
                                 "checkpoints, and a stopped run is not named interrupted by "
                                 "report"}),
        Site("lightning.fabric.plugins.io.torch_io", "_atomic_save", make_atomic_save,
             patch="checkpoint",
             lost="a Lightning checkpoint on another disk than the temp folder is copied over "
                  "the old one: a full disk or a kill during the copy leaves it torn"),
        Site("lightning.pytorch.strategies.strategy", "Strategy.load_model_state_dict",
             make_load_model_state_dict, patch="checkpoint",
             lost="fit(ckpt_path=) into a model whose vocabulary grew stops at a size "
                  "mismatch"),
        Site("lightning.pytorch.strategies.strategy", "Strategy.load_optimizer_state_dict",
             make_load_optimizer_state_dict, patch="checkpoint",
             lost="the optimizer moments of grown rows keep the old shape and the first "
                  "step fails"),
    ),
))
