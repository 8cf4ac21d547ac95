"""Integration ``transformers_trainer``: the Hugging Face ``transformers.Trainer`` (4.57 to 5.x).

The generic patches already hold every name a Trainer step goes through: ``training_step``
backpropagates through ``Tensor.backward`` (the NaN guard sees the loss), the clip goes
through ``accelerator.clip_grad_norm_`` to ``torch.nn.utils.clip_grad_norm_``, and
``optimizer.step()`` reaches the guard's global hooks. Upstream itself only filters a NaN
loss out of the *logged* loss (``logging_nan_inf_filter``) and steps the optimizer on its NaN
gradients; its ``optimizer_step_was_skipped`` knows only accelerate's fp16 GradScaler.

What this adds: the run's records (``nonfinite_events.jsonl``, ...) go to the Trainer's
``args.output_dir`` instead of ``./training_patches``, each carrying ``state.global_step``
as its ``trainer_step``; and the skip flags of the fused optimizer (``adamw_torch_fused``,
the default from torch 2.8), which the guard reads only every few steps, are read at each
``on_save`` and at ``on_train_end``, so a skip just before a save or the end is on disk when
``train()`` returns. A folder the user set (``TRAINING_PATCHES_OUTPUT_DIR``,
``patches.set_output_dir``) still wins.

Not done: ``_save_checkpoint`` is not made atomic (no manifest), and
``resume_from_checkpoint`` into a grown vocabulary is not remapped.
"""

from __future__ import annotations

import functools
from typing import Any

from .. import _run, nan_guard
from .._registry import Integration, Site, register_integration

NAME = "transformers_trainer"
DISTRIBUTION = "transformers"
SUPPORTED = ">=4.57,<6"
MODULE = "transformers.trainer"


@functools.cache
def _callback_class() -> type:
    """The TrainerCallback class, made once (so that "already added" is an isinstance test)."""
    from transformers import TrainerCallback  # lazy: transformers is imported by now

    class TrainingPatchesCallback(TrainerCallback):
        """Hands the Trainer's step to the records; settles the guard's waiting flags."""

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            _run.trainer_step = int(state.global_step)

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            nan_guard.settle()

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            nan_guard.settle()

    return TrainingPatchesCallback


def make_train(original: Any) -> Any:
    """``Trainer.train`` that first tells the patches where the Trainer writes and how it
    counts its steps."""
    @functools.wraps(original)
    def train(self: Any, *args: Any, **kwargs: Any) -> Any:
        _run.set_trainer_dir(getattr(self.args, "output_dir", None))
        callback = _callback_class()
        if not any(isinstance(c, callback) for c in self.callback_handler.callbacks):
            self.add_callback(callback())
        return original(self, *args, **kwargs)
    return train


INTEGRATION = register_integration(Integration(
    name=NAME,
    distribution=DISTRIBUTION,
    supported=SUPPORTED,
    module="transformers",
    describe="records in the Trainer's output_dir with its global_step, the fused "
             "optimizer's skips recorded by each save and the end of train()",
    sites=(
        Site(MODULE, "Trainer.train", make_train, patch="nan_guard",
             lost="a Hugging Face Trainer's records go to ./training_patches, not its "
                  "output_dir, carry no trainer step, and a fused step's skip near a save "
                  "or the end is written only at exit"),
    ),
))
