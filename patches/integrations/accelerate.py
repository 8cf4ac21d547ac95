"""Integration ``accelerate``: Hugging Face accelerate (``accelerate launch``), 1.x.

What it adds to the generic patches: accelerate builds its fp16 loss scaler in
``Accelerator.__init__``. For DDP and FSDP1 it goes through
``accelerate.utils.modeling.get_grad_scaler``, which looks up ``torch.amp.GradScaler``
(or FSDP's ``ShardedGradScaler``) at call time, so the generic ``grad_scaler`` patch
reaches it. For FSDP2 it calls ``get_fsdp2_grad_scaler``, which imports the class from
``torch.amp.grad_scaler`` (a name the generic patch leaves alone, it being torch's own
module): that binding becomes SafeGradScaler here.

Everything else accelerate does in a training step goes through names the generic
patches already hold: ``Accelerator.backward`` calls ``Tensor.backward`` (the NaN guard
sees the loss), ``accelerator.clip_grad_norm_`` calls ``torch.nn.utils.clip_grad_norm_``
by attribute, and its ``AcceleratedOptimizer.step`` calls the torch optimizer's ``step``
(the guard's hook).
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
