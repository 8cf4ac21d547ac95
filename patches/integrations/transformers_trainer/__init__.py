"""Integration ``transformers_trainer``: the Hugging Face ``transformers.Trainer`` (4.57 to 5.x).

Sites on the Trainer: records in ``args.output_dir`` with ``state.global_step``; the fused
optimizer's skip flags read at each save and at the end; ``checkpoint-N/`` marked complete
(``training_patches_complete.json``) and a torn one never resumed; ``resume_from_checkpoint``
into a grown vocabulary (:mod:`patches.checkpoint.grown`, spelled with ``processing_class``);
one run per ``output_dir`` with its ``trainer_runs.jsonl`` (:mod:`patches.integrations.trainers`).
:func:`reading_callback`: the reading gap at each evaluation (:mod:`patches.learning`).
Declared here; :mod:`.sites` does the work, imported when a site lands or one of its names
is first used.

Design: docs/design/trainers.md
"""

from __future__ import annotations

from ..._registry import Integration, Site, register_integration
from .. import implementation

NAME = "transformers_trainer"
DISTRIBUTION = "transformers"
SUPPORTED = ">=4.57,<6"
MODULE = "transformers.trainer"

_made, __getattr__ = implementation(__name__)

INTEGRATION = register_integration(Integration(
    name=NAME,
    distribution=DISTRIBUTION,
    supported=SUPPORTED,
    module="transformers",
    describe="records in the Trainer's output_dir with its global_step, the fused "
             "optimizer's skips recorded by each save and the end of train(), one run per "
             "output_dir with its start and end recorded, checkpoint folders marked complete "
             "and torn ones never resumed, a resume into a grown vocabulary",
    sites=(
        Site(MODULE, "Trainer.train", _made("make_train"), patch=("nan_guard", "checkpoint"),
             lost={"nan_guard": "a Hugging Face Trainer's records go to ./training_patches, "
                                "not its output_dir, carry no trainer step, and a fused "
                                "step's skip near a save or the end is written only at exit",
                   "checkpoint": "two Hugging Face runs into one output_dir overwrite each "
                                 "other's checkpoints, and a run killed outright is not found "
                                 "by report"}),
        Site(MODULE, "Trainer._save_checkpoint", _made("make_save_checkpoint"),
             patch="checkpoint",
             lost="a Hugging Face checkpoint folder cut short by a kill looks complete"),
        Site(MODULE, "get_last_checkpoint", _made("make_get_last_checkpoint"),
             patch="checkpoint",
             lost="resume_from_checkpoint=True resumes from a torn checkpoint folder"),
        Site(MODULE, "Trainer._load_from_checkpoint", _made("make_load_from_checkpoint"),
             patch="checkpoint",
             lost="resume_from_checkpoint into a model whose vocabulary grew stops at a "
                  "size mismatch"),
        Site(MODULE, "Trainer._load_optimizer_and_scheduler",
             _made("make_load_optimizer_and_scheduler"), patch="checkpoint",
             lost="the optimizer moments of grown rows keep the old shape and the first "
                  "step fails"),
        Site("transformers.trainer_utils", "get_last_checkpoint",
             _made("make_get_last_checkpoint"), patch="checkpoint",
             lost="a script's get_last_checkpoint(output_dir) picks a torn checkpoint folder"),
    ),
))
