"""``autocast``: the deprecated AMP names behave as their modern equivalents.

``torch.cuda.amp.autocast(...)``, ``torch.cpu.amp.autocast(...)``,
``torch.cuda.amp.GradScaler(...)`` and ``torch.cuda.amp.custom_fwd/custom_bwd``
emit a FutureWarning on every use in torch 2.4+. After this patch they are the
``torch.amp`` objects with the same arguments and emit nothing. (With the
``grad_scaler`` patch on, ``torch.cuda.amp.GradScaler`` is a SafeGradScaler: that site is
declared once, by :mod:`patches.grad_scaler`, for both patches.)
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch.amp.autocast_mode import autocast as _modern_autocast

from ._registry import PatchSpec, Site, register


class CudaAutocast(_modern_autocast):
    """``torch.amp.autocast("cuda", ...)`` with the deprecated class's signature."""

    def __init__(self, enabled: bool = True, dtype: torch.dtype = torch.float16,
                 cache_enabled: bool = True) -> None:
        super().__init__("cuda", enabled=enabled, dtype=dtype, cache_enabled=cache_enabled)


class CpuAutocast(_modern_autocast):
    """``torch.amp.autocast("cpu", ...)`` with the deprecated class's signature."""

    def __init__(self, enabled: bool = True, dtype: torch.dtype = torch.bfloat16,
                 cache_enabled: bool = True) -> None:
        super().__init__("cpu", enabled=enabled, dtype=dtype, cache_enabled=cache_enabled)


class CudaGradScaler(torch.amp.grad_scaler.GradScaler):
    """``torch.amp.GradScaler("cuda", ...)`` with the deprecated class's signature."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 enabled: bool = True) -> None:
        super().__init__("cuda", init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                         enabled=enabled)


def custom_fwd(fwd: Callable[..., Any] | None = None, *,
               cast_inputs: torch.dtype | None = None) -> Any:
    """``torch.amp.custom_fwd(device_type="cuda", ...)`` under the deprecated name."""
    if fwd is None:
        return functools.partial(custom_fwd, cast_inputs=cast_inputs)
    return torch.amp.custom_fwd(fwd, device_type="cuda", cast_inputs=cast_inputs)


def custom_bwd(bwd: Callable[..., Any]) -> Any:
    """``torch.amp.custom_bwd(device_type="cuda")`` under the deprecated name."""
    return torch.amp.custom_bwd(bwd, device_type="cuda")


def _constant(value: Any) -> Callable[[Any], Any]:
    return lambda original: value


SPEC = register(PatchSpec(
    name="autocast",
    describe=lambda o: "torch.cuda.amp / torch.cpu.amp autocast and GradScaler -> torch.amp "
                       "(no FutureWarning)",
    sites=(
        Site("torch.cuda.amp", "autocast", _constant(CudaAutocast), sweep=True),
        Site("torch.cpu.amp", "autocast", _constant(CpuAutocast), sweep=True),
        Site("torch.cuda.amp", "custom_fwd", _constant(custom_fwd), sweep=True),
        Site("torch.cuda.amp", "custom_bwd", _constant(custom_bwd), sweep=True),
    ),
))
