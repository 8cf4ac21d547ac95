"""``grad_clip``: ``clip_grad_norm_`` that clips the true gradients and survives NaN/Inf.

torch's ``clip_grad_norm_`` has two traps in mixed precision training:

- called between ``scaler.scale(loss).backward()`` and ``scaler.step()`` without
  ``scaler.unscale_(optimizer)``, it clips the *scaled* gradients, so the
  threshold is off by the loss scale;
- with a non-finite total norm its clip coefficient is NaN or 0, which turns
  every finite gradient into NaN or zero.

The replacement computes the total norm once; when a SafeGradScaler scaled the
loss and these gradients were not unscaled yet, it divides that norm by the
scale (scaled gradients clipped by the true norm's coefficient are the true
clipped gradients, scaled). A non-finite norm leaves the gradients untouched,
is counted on the device (no sync) and is returned, so the step can be skipped.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

import torch
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from . import grad_scaler
from ._counters import DeviceCounters
from ._registry import PatchSpec, Site, register

# Only the non-finite flag lives on the device; the other counts are known on the host.
_counts = DeviceCounters("nonfinite_norms")
_host = {"calls": 0, "unscaled_first": 0}
# The norm of the latest clip and the gradients it covered: the NaN guard reuses it, so
# one reduction serves both the clip and the finite check.
_last: tuple[frozenset[int], torch.Tensor] | None = None  # (gradient ids, non-finite flag)


def safe_clip_grad_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float,
                         norm_type: float = 2.0, foreach: bool | None = None) -> torch.Tensor:
    """Clip gradients by their true total norm; return it (non-finite norms clip nothing)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    with_grad = [p for p in params if p.grad is not None]
    if not with_grad:
        return torch.tensor(0.0)
    with torch.no_grad():
        total = get_total_norm([p.grad for p in with_grad], norm_type, False, foreach)
        scaler = grad_scaler.pending_scaler()
        if scaler is not None and not all(id(p) in scaler._tp_unscaled for p in with_grad):
            total = total / scaler._scale.to(total.device, non_blocking=True)
            _host["unscaled_first"] += 1
        nonfinite = ~torch.isfinite(total)
        # A zero norm gives a clip coefficient of 1: non-finite gradients stay as they are
        # for the scaler or the NaN guard to skip, finite ones are not destroyed.
        clip_grads_with_norm_(with_grad, max_norm, total.masked_fill(nonfinite, 0.0), foreach)
        _counts.add("nonfinite_norms", nonfinite)
    _host["calls"] += 1
    global _last
    _last = (frozenset(id(p.grad) for p in with_grad), nonfinite)
    return total


def nonfinite_for(grads: list[torch.Tensor]) -> torch.Tensor | None:
    """The latest clip's non-finite flag if it covered all of ``grads`` (then forgotten)."""
    global _last
    last, _last = _last, None
    if last is None or not all(id(g) in last[0] for g in grads):
        return None
    return last[1]


def _make(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(original)
    def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        if error_if_nonfinite:  # the caller asked for torch's error: keep its behaviour
            return original(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
        return safe_clip_grad_norm_(parameters, max_norm, norm_type, foreach)
    return clip_grad_norm_


def stats() -> dict[str, int]:
    return {**_host, **_counts.read()}


def load_stats(counts: dict[str, int]) -> None:
    """Restore counts saved from :func:`stats` (e.g. on resume)."""
    _counts.load(counts)
    for name in _host:
        _host[name] = int(counts.get(name, 0))


SPEC = register(PatchSpec(
    name="grad_clip",
    describe=lambda o: "clip_grad_norm_ unscales first and leaves gradients intact on a "
                       "non-finite norm",
    sites=(
        Site("torch.nn.utils", "clip_grad_norm_", _make, sweep=True),
        Site("torch.nn.utils.clip_grad", "clip_grad_norm_", _make),
    ),
))
