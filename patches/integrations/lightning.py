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
"""

from __future__ import annotations

import functools
from typing import Any

from .. import _run, nan_guard
from .._registry import Integration, Site, register_integration

NAME = "lightning"
DISTRIBUTION = "lightning"
SUPPORTED = ">=2.6,<2.7"
MODULE = "lightning.pytorch.trainer.trainer"


def _step_callback() -> Any:
    """A Callback that hands the Trainer's step to the records before each batch, and
    records the fused steps' waiting skips (read in batches) at each checkpoint and at the
    end of training."""
    from lightning.pytorch.callbacks import Callback  # lazy: lightning is imported by now

    class TrainerStep(Callback):
        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            _run.trainer_step = int(trainer.global_step)

        def on_save_checkpoint(self, *args: Any) -> None:
            nan_guard.settle()

        def on_train_end(self, *args: Any) -> None:
            nan_guard.settle()

    return TrainerStep()


def make_fit(original: Any) -> Any:
    """``Trainer.fit`` that first tells the patches where the Trainer writes and how it
    counts its steps."""
    @functools.wraps(original)
    def fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            _run.set_trainer_dir(self.log_dir or self.default_root_dir)
        except Exception:  # noqa: BLE001 - a logger that cannot say: the default folder stays
            pass
        if not any(type(c).__name__ == "TrainerStep" for c in self.callbacks):
            self.callbacks.append(_step_callback())
        return original(self, *args, **kwargs)
    return fit


INTEGRATION = register_integration(Integration(
    name=NAME,
    distribution=DISTRIBUTION,
    supported=SUPPORTED,
    module="lightning",
    describe="records in the Trainer's log_dir with its global_step (the step(closure) "
             "decision is the generic guard's)",
    sites=(
        Site(MODULE, "Trainer.fit", make_fit, patch="nan_guard",
             lost="a Lightning run's records go to ./training_patches, not the Trainer's "
                  "log_dir, and carry no trainer step"),
    ),
))
