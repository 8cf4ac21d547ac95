"""Integration ``accelerate``: Hugging Face accelerate (``accelerate launch``), 1.x.

accelerate's FSDP2 fp16 path calls ``get_fsdp2_grad_scaler``, which imports the scaler from
``torch.amp.grad_scaler`` (a name the generic patch leaves alone): that binding becomes
SafeGradScaler here. DDP/FSDP1 (``get_grad_scaler``), the backward, the clip and the step go
through names the generic patches hold already.
"""

from __future__ import annotations

import functools
from typing import Any

from .._registry import Integration, Site, register_integration
from ..grad_scaler import SafeGradScaler

NAME = "accelerate"
DISTRIBUTION = "accelerate"
SUPPORTED = ">=1.0,<2"
MODULE = "accelerate.accelerator"  # where Accelerator.__init__ finds get_fsdp2_grad_scaler


def fsdp2_scaler_factory(original: Any) -> Any:
    """``get_fsdp2_grad_scaler(**kwargs)`` returning a SafeGradScaler: the same keyword
    arguments (``device`` and a ``GradScalerKwargs`` handler's), our defaults for the rest."""
    @functools.wraps(original)
    def get_fsdp2_grad_scaler(**kwargs: Any) -> SafeGradScaler:
        return SafeGradScaler(**kwargs)
    return get_fsdp2_grad_scaler


INTEGRATION = register_integration(Integration(
    name=NAME,
    distribution=DISTRIBUTION,
    supported=SUPPORTED,
    module="accelerate",
    describe="SafeGradScaler in accelerate's FSDP2 fp16 path (DDP/FSDP1 are covered by "
             "the generic patches)",
    sites=(
        Site(MODULE, "get_fsdp2_grad_scaler", fsdp2_scaler_factory, patch="grad_scaler",
             lost="accelerate's FSDP2 fp16 path builds torch's GradScaler (initial scale "
                  "65536, no skip counters, no loss-scale floor)"),
    ),
))
