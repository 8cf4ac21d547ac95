"""Integration ``f5_tts``: F5-TTS's own ``Trainer`` (``f5_tts.model.trainer``, 1.1.x), on
accelerate, with an ``ema_pytorch`` EMA model and fused AdamW.

Sites on the Trainer: records in ``checkpoint_path`` with F5's update count; fused skips read
at each save and at the end; the EMA's base rows kept with the model's; one run per
``checkpoint_path`` (:mod:`patches.integrations.trainers`); ``model_last.pt``/``model_N.pt``
written atomically; ``load_checkpoint`` into a grown vocabulary (spelled with
``vocab_char_map``). F5 has no evaluation loop: :func:`watch_reading` measures the reading
gap at each save, on :func:`flow_matching_losses`. Declared here; :mod:`.sites` does the
work, imported when a site lands or one of its names is first used.

Design: docs/design/trainers.md
"""

from __future__ import annotations

from ..._registry import Integration, Site, register_integration
from .. import implementation

NAME = "f5_tts"
DISTRIBUTION = "f5-tts"
SUPPORTED = ">=1.1,<1.2"
MODULE = "f5_tts.model.trainer"

_made, __getattr__ = implementation(__name__)

INTEGRATION = register_integration(Integration(
    name=NAME,
    distribution=DISTRIBUTION,
    supported=SUPPORTED,
    module="f5_tts",
    describe="records in the Trainer's checkpoint_path with its update count, the fused "
             "optimizer's skips recorded by each save and the end of train(), the EMA's "
             "base rows kept with the model's, one run per checkpoint_path with its start "
             "and end recorded, checkpoints written atomically, a resume "
             "into a grown vocabulary, the reading gap at each save (watch_reading)",
    sites=(
        Site(MODULE, "Trainer.train", _made("make_train"), patch=("nan_guard", "checkpoint"),
             lost={"nan_guard": "an F5-TTS run's records go to ./training_patches, not its "
                                "checkpoint folder, carry no trainer step, a fused step's "
                                "skip near the end is written only at exit, and the EMA's "
                                "base rows drift while the model's are frozen",
                   "checkpoint": "two F5-TTS runs into one checkpoint_path overwrite each "
                                 "other's model_last.pt, and a stopped run is not found by "
                                 "report"}),
        Site(MODULE, "Trainer.save_checkpoint", _made("make_save_checkpoint"),
             patch=("checkpoint", "learning"),
             lost={"checkpoint": "a kill or a full disk during an F5-TTS save leaves a torn "
                                 "model_last.pt that the next start cannot read",
                   "learning": "a monitor given to f5_tts.watch_reading measures nothing: "
                               "the reading gap of an F5-TTS run goes unmeasured"}),
        Site(MODULE, "Trainer.load_checkpoint", _made("make_load_checkpoint"), patch="checkpoint",
             lost="an F5-TTS resume into a model whose vocabulary grew stops at a size "
                  "mismatch"),
    ),
))
