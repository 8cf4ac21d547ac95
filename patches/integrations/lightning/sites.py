"""What the ``lightning`` integration's sites do (declared in
:mod:`patches.integrations.lightning`, which imports this module when one lands), and
:func:`reading_callback`."""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from ... import _run, learning, nan_guard
from .. import trainers
from . import NAME

if TYPE_CHECKING:  # imported where used: heavy (issue 41)
    from ...checkpoint import grown

NAME_SAID = "Lightning's Trainer"


@functools.cache
def _classes() -> dict[str, type]:
    """The integration's Callbacks, made once on first use and named as its own
    (``__getattr__``: ``ddp_spawn`` pickles them). ``TrainerStep`` hands the Trainer's step to
    the records before each batch, and records the fused steps' waiting skips at each
    checkpoint and at the end; ``RunClaim`` claims the Trainer's folder and records the
    run's start at ``on_fit_start``: after the loggers made their folders (a CSVLogger
    deletes the metrics.csv of a version folder that is not empty), before any save."""
    from lightning.pytorch.callbacks import Callback  # lazy: lightning is imported by now

    class TrainerStep(Callback):
        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            _run.current().trainer_step = int(trainer.global_step)

        def on_save_checkpoint(self, *args: Any) -> None:
            nan_guard.settle()

        def on_train_end(self, *args: Any) -> None:
            nan_guard.settle()

    class ReadingCallback(Callback):
        """Measures the reading gap after each validation, on global rank 0."""

        def __init__(self, monitor: learning.LearningMonitor) -> None:
            self.monitor = monitor

        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            if trainer.sanity_checking:
                return
            if _run.output_dir() is None:  # beside the Trainer's files, as fit()'s site puts them
                # on every rank: Lightning's log_dir is a broadcast, which rank 0 alone would
                # wait in for ever under DDP
                _run.set_trainer_dir(_folder(trainer))
            if not trainer.is_global_zero:
                return
            loss = trainer.callback_metrics.get("val_loss")
            learning.evaluate_once(self.monitor, pl_module, int(trainer.global_step),
                                   eval_loss=None if loss is None else float(loss))

    class RunClaim(Callback):
        def on_fit_start(self, trainer: Any, *args: Any) -> None:
            run = _runs.get(trainer)
            if run is not None:
                run.start(_folder(trainer))

    made = {"TrainerStep": TrainerStep, "ReadingCallback": ReadingCallback, "RunClaim": RunClaim}
    for name, cls in made.items():
        cls.__module__, cls.__qualname__ = __package__, name
    return made


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
    return _classes()["ReadingCallback"](checked)


def __getattr__(name: str) -> Any:
    """The callback classes, made on first use (pickle's way back to them, in any process)."""
    if name in ("TrainerStep", "ReadingCallback", "RunClaim"):
        return _classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_fit(original: Any) -> Any:
    """``Trainer.fit`` (:func:`.trainers.run_parts`): the Trainer's ``log_dir`` claimed for
    this run on global rank 0, at ``on_fit_start``; the records told where it writes and its
    steps (its callback)."""
    return trainers.run_parts(original, _recorded_run, _steps_counted)


@contextlib.contextmanager
def _steps_counted(trainer: Any) -> Iterator[None]:
    with contextlib.suppress(Exception):  # a logger that cannot say: the default stays
        _run.set_trainer_dir(trainer.log_dir or trainer.default_root_dir)
    _add_once(trainer, "TrainerStep")
    yield


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


def _add_once(trainer: Any, name: str) -> None:
    if not any(isinstance(c, _classes()[name]) for c in trainer.callbacks):
        trainer.callbacks.append(_classes()[name]())


def _recorded_run(trainer: Any) -> contextlib.AbstractContextManager[None]:
    """The run's record, started by the ``RunClaim`` callback; the context records the end."""
    run = trainers.RunRecord(
        trainer=NAME, said=NAME_SAID, overwritten="checkpoints and logs",
        step=lambda: int(trainer.global_step), checkpoint=lambda: _last_checkpoint(trainer),
        continue_with="trainer.fit(model, ckpt_path=<that checkpoint>)",
        writes=bool(getattr(trainer, "is_global_zero", True)))
    _runs[trainer] = run
    _add_once(trainer, "RunClaim")
    return run.ending()


def make_atomic_save(original: Any) -> Any:
    """``_atomic_save(checkpoint, filepath)`` of Lightning's TorchCheckpointIO: a local path
    through the library's atomic writer, a remote one (fsspec URL) to the original."""
    @functools.wraps(original)
    def _atomic_save(checkpoint: Any, filepath: Any) -> None:
        text = str(filepath)
        if "://" in text and not text.startswith("file://"):
            return original(checkpoint, filepath)
        from ...checkpoint.atomic import atomic_torch_save  # lazy: heavy (issue 41)

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
            from ...checkpoint import grown  # lazy: heavy (issue 41)

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
    from ...checkpoint import grown  # lazy: heavy (issue 41)

    return grown.TrainerResume(NAME_SAID, restores, int(step) if isinstance(step, int) else None,
                               tokenizer, source)


def make_load_optimizer_state_dict(original: Any) -> Any:
    """``Strategy.load_optimizer_state_dict`` that grows the loaded moments of the rows
    :func:`make_load_model_state_dict` grew (:func:`.trainers.growing_moments`)."""
    return trainers.growing_moments(original, lambda strategy: strategy.optimizers)
