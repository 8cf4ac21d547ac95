"""Integration ``lightning``: Lightning 2.6 (``lightning.pytorch.Trainer``).

Sites on the Trainer: records in ``Trainer.log_dir`` with ``global_step``; fused skips
recorded at each save and at the end; local checkpoints written atomically beside
themselves; ``fit(ckpt_path=...)`` into a grown vocabulary (:mod:`patches.checkpoint.grown`,
spelled with the module's or datamodule's ``tokenizer``); one run per ``log_dir`` with its
``trainer_runs.jsonl`` (:mod:`patches.integrations.trainers`). :func:`reading_callback`: the
reading gap after each validation (:mod:`patches.learning`). Declared here; :mod:`.sites`
does the work, imported when a site lands or one of its names is first used.

Design: docs/design/trainers.md
"""

from __future__ import annotations

from ..._registry import Integration, Site, register_integration
from .. import implementation

NAME = "lightning"
DISTRIBUTION = "lightning"
SUPPORTED = ">=2.6,<2.7"
MODULE = "lightning.pytorch.trainer.trainer"

_made, __getattr__ = implementation(__name__)

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
        Site(MODULE, "Trainer.fit", _made("make_fit"), patch=("nan_guard", "checkpoint"),
             lost={"nan_guard": "a Lightning run's records go to ./training_patches, not the "
                                "Trainer's log_dir, and carry no trainer step",
                   "checkpoint": "two Lightning runs into one log_dir overwrite each other's "
                                 "checkpoints, and a stopped run is not named interrupted by "
                                 "report"}),
        Site("lightning.fabric.plugins.io.torch_io", "_atomic_save", _made("make_atomic_save"),
             patch="checkpoint",
             lost="a Lightning checkpoint on another disk than the temp folder is copied over "
                  "the old one: a full disk or a kill during the copy leaves it torn"),
        Site("lightning.pytorch.strategies.strategy", "Strategy.load_model_state_dict",
             _made("make_load_model_state_dict"), patch="checkpoint",
             lost="fit(ckpt_path=) into a model whose vocabulary grew stops at a size "
                  "mismatch"),
        Site("lightning.pytorch.strategies.strategy", "Strategy.load_optimizer_state_dict",
             _made("make_load_optimizer_state_dict"), patch="checkpoint",
             lost="the optimizer moments of grown rows keep the old shape and the first "
                  "step fails"),
    ),
))
