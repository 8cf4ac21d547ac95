"""Integration ``lightning``: Lightning 2.6 (``lightning.pytorch.Trainer``).

The generic patches already hold every name a Lightning step goes through: automatic
optimization calls ``optimizer.step(closure)`` (the NaN guard runs the closure first and
decides on its gradients), the precision plugins build ``torch.amp.GradScaler`` (a
SafeGradScaler), and ``clip_gradients`` calls ``torch.nn.utils.clip_grad_norm_``.

What this adds: the run's records (``nonfinite_events.jsonl``, ...) go to the Trainer's own
folder (``Trainer.log_dir``: the logger's version folder, else ``default_root_dir``) instead
of ``./training_patches``, and each record carries the Trainer's ``global_step`` as its
``trainer_step``. A folder the user set (``TRAINING_PATCHES_OUTPUT_DIR``,
``patches.set_output_dir``) still wins. The skips of fused steps, whose flags are read in
batches, are recorded at each ``save_checkpoint`` and at the end of training.

Checkpoints: Lightning's ``_atomic_save`` writes the bytes to a temporary file in the system
temp folder and moves it over the checkpoint, without fsync. When the checkpoint folder is
on another disk (a mounted volume), that move is a copy into the old file: a full disk or a
kill during it leaves a torn ``last.ckpt``, the good one gone. Here a local checkpoint is
written like every checkpoint of the library (:func:`patches.checkpoint.atomic_torch_save`:
free space checked first, a temporary file in the same folder, fsync, ``os.replace``), so
the previous file stays whole until the new one is. ``fit(ckpt_path=...)`` into a model
whose vocabulary grew since the save (upstream: a size mismatch) loads the weights through
``patches.load_checkpoint`` and grows the loaded moments of the grown rows
(:mod:`patches.checkpoint.grown`); strategies with their own load (FSDP, DeepSpeed) are
upstream's.

The reading gap (:mod:`patches.learning`): a LightningModule's loss on one (text, audio)
pair is its own, so :func:`reading_callback` takes a monitor that holds it and measures
after each validation.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .. import _run, learning, nan_guard
from .._registry import Integration, Site, register_integration
from ..checkpoint import atomic_torch_save, grown

NAME = "lightning"
DISTRIBUTION = "lightning"
SUPPORTED = ">=2.6,<2.7"
MODULE = "lightning.pytorch.trainer.trainer"


@functools.cache
def _callback_class() -> type:
    """The Callback that hands the Trainer's step to the records before each batch, and
    records the fused steps' waiting skips (read in batches) at each checkpoint and at the
    end of training. Made once, on first use (lightning is imported by then), and reachable
    as this module's ``TrainerStep`` (``__getattr__`` below): ``ddp_spawn`` pickles the
    Trainer with its callbacks, and a class local to a function cannot be pickled."""
    from lightning.pytorch.callbacks import Callback  # lazy: lightning is imported by now

    class TrainerStep(Callback):
        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            _run.trainer_step = int(trainer.global_step)

        def on_save_checkpoint(self, *args: Any) -> None:
            nan_guard.settle()

        def on_train_end(self, *args: Any) -> None:
            nan_guard.settle()

    TrainerStep.__module__, TrainerStep.__qualname__ = __name__, "TrainerStep"
    return TrainerStep


@functools.cache
def _reading_class() -> type:
    """The Callback of :func:`reading_callback`, made once, reachable as this module's
    ``ReadingCallback`` (``__getattr__`` below) so that ``ddp_spawn`` can pickle it."""
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

        monitor = patches.LearningMonitor(probe, loss_fn)  # loss_fn(module, texts, audios)
        Trainer(..., val_check_interval=500, callbacks=[lightning.reading_callback(monitor)])

    The module runs on global rank 0 alone (so not with sharded parameters: FSDP, DeepSpeed
    stage 3); the records go to ``learning_health.jsonl`` in the Trainer's ``log_dir``. A
    monitor without ``loss_fn`` is a TypeError here, not at validation."""
    checked = learning.checked_monitor(monitor, "lightning.reading_callback")
    return _reading_class()(checked)


def __getattr__(name: str) -> Any:
    if name == "TrainerStep":  # pickle's way back to the class, in any process
        return _callback_class()
    if name == "ReadingCallback":
        return _reading_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_fit(original: Any) -> Any:
    """``Trainer.fit`` that first tells the patches where the Trainer writes and how it
    counts its steps."""
    @functools.wraps(original)
    def fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            _run.set_trainer_dir(self.log_dir or self.default_root_dir)
        except Exception:  # noqa: BLE001 - a logger that cannot say: the default folder stays
            pass
        if not any(isinstance(c, _callback_class()) for c in self.callbacks):
            self.callbacks.append(_callback_class()())
        return original(self, *args, **kwargs)
    return fit


def make_atomic_save(original: Any) -> Any:
    """``_atomic_save(checkpoint, filepath)`` of Lightning's TorchCheckpointIO: a local path
    through the library's atomic writer, a remote one (fsspec URL) to the original."""
    @functools.wraps(original)
    def _atomic_save(checkpoint: Any, filepath: Any) -> None:
        text = str(filepath)
        if "://" in text and not text.startswith("file://"):
            return original(checkpoint, filepath)
        atomic_torch_save(checkpoint, Path(text.removeprefix("file://")))
    return _atomic_save


def make_load_model_state_dict(original: Any) -> Any:
    """``Strategy.load_model_state_dict(checkpoint, strict)`` that loads a checkpoint into a
    LightningModule whose vocabulary grew since the save, through the library."""
    @functools.wraps(original)
    def load_model_state_dict(self: Any, checkpoint: Mapping[str, Any], strict: bool = True
                              ) -> Any:
        self._training_patches_grown = None
        module = self.lightning_module
        state = checkpoint.get("state_dict") if isinstance(checkpoint, Mapping) else None
        path = getattr(getattr(module, "_trainer", None), "ckpt_path", None)
        if isinstance(state, Mapping) and path and "://" not in str(path):
            changes = grown.vocabulary_growth(grown.tensor_shapes(state), module)
            if changes:  # read again from the file: the loader validates what it loads
                self._training_patches_grown = grown.load_grown(
                    Path(path), module, set(state), strict=strict)
                return None
        return original(self, checkpoint, strict)
    return load_model_state_dict


def make_load_optimizer_state_dict(original: Any) -> Any:
    """``Strategy.load_optimizer_state_dict`` that grows the loaded moments of the rows
    :func:`make_load_model_state_dict` grew."""
    @functools.wraps(original)
    def load_optimizer_state_dict(self: Any, checkpoint: Mapping[str, Any]) -> Any:
        result = original(self, checkpoint)
        rows = getattr(self, "_training_patches_grown", None)
        if rows:
            for optimizer in self.optimizers:
                grown.grow_loaded_moments(optimizer, rows)
        return result
    return load_optimizer_state_dict


INTEGRATION = register_integration(Integration(
    name=NAME,
    distribution=DISTRIBUTION,
    supported=SUPPORTED,
    module="lightning",
    describe="records in the Trainer's log_dir with its global_step (the step(closure) "
             "decision is the generic guard's); checkpoints written atomically beside "
             "themselves; fit(ckpt_path=) into a grown vocabulary",
    sites=(
        Site(MODULE, "Trainer.fit", make_fit, patch="nan_guard",
             lost="a Lightning run's records go to ./training_patches, not the Trainer's "
                  "log_dir, and carry no trainer step"),
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
