"""Integration ``deepspeed``: DeepSpeed's engine (``deepspeed.initialize``), 0.16-0.19.

- **The freeze through the engine.** Under ZeRO-1/2 and bf16/fp16 the optimizer steps fp32
  master copies of the weights, which DeepSpeed copies back into the module: the freeze's
  restore of the module's rows never reaches them (the base rows drift: 0.09 measured, ZeRO-1
  bf16). After each engine step the frozen rows are put back in the masters and the module;
  ``TRAINING_PATCHES_BASE_VOCAB`` applies to the engine's module when it is built. ZeRO-3
  partitions the parameters themselves: the freeze is refused there, loudly.
- **The engine's own fp16 overflow skips** are recorded (``kind: trainer_skip``), and its
  ``global_steps`` is each record's ``trainer_step``.
- **A resume into a grown vocabulary** (``load_checkpoint`` cannot grow the flattened
  optimizer partitions) is refused before anything loads, naming what works: the consolidated
  fp32 weights loaded with ``patches.load_checkpoint`` before ``deepspeed.initialize``.
Declared here; :mod:`.sites` does the work, imported when a site lands. The user's view:
docs/quickstart/deepspeed.md.
"""

from __future__ import annotations

from ..._registry import Integration, Site, register_integration
from .. import implementation

NAME = "deepspeed"
DISTRIBUTION = "deepspeed"
SUPPORTED = ">=0.16,<0.20"
MODULE = "deepspeed.runtime.engine"

_made, __getattr__ = implementation(__name__)

INTEGRATION = register_integration(Integration(
    name=NAME,
    distribution=DISTRIBUTION,
    supported=SUPPORTED,
    module="deepspeed",
    describe="the base-vocabulary freeze through DeepSpeed's fp32 master weights (ZeRO-1/2, "
             "bf16/fp16); the engine's own overflow skips recorded; a resume into a grown "
             "vocabulary refused in one paragraph that says what to do",
    sites=(
        Site(MODULE, "DeepSpeedEngine.step", _made("make_step"), patch="vocab_freeze",
             lost="under DeepSpeed ZeRO-1/2 or bf16/fp16 the frozen base rows train (the "
                  "optimizer steps the fp32 masters), and the engine's own overflow skips go "
                  "unrecorded"),
        Site(MODULE, "DeepSpeedEngine.load_checkpoint", _made("make_load_checkpoint"),
             patch="checkpoint",
             lost="the refusal of a DeepSpeed resume into a grown vocabulary cannot name the "
                  "checkpoint's folder and tag"),
        Site(MODULE, "DeepSpeedEngine.load_module_state_dict", _made("make_load_module_state_dict"),
             patch="checkpoint",
             lost="a DeepSpeed resume into a grown vocabulary stops at torch's size mismatch "
                  "in the middle of its load, with no word of what to do"),
    ),
))
