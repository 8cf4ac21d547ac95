"""``grad_clip``: ``clip_grad_norm_`` that survives NaN/Inf and, if asked, unscales first.

:func:`safe_clip_grad_norm_` replaces torch's ``clip_grad_norm_``: a NaN/Inf total norm
leaves the gradients untouched, is counted and returned (the step can be skipped); a
finite one clips exactly as torch does. Under a SafeGradScaler the clip is torch's unless
:func:`unscale_first` (``TRAINING_PATCHES_CLIP_UNSCALE_FIRST=1``) says ``max_norm`` limits
the true gradients. Each clip leaves its non-finite flag in the step context for the NaN
guard (docs/design/step.md): the user calls the clip before the optimizer step, so it is
no stage of the step pipeline but hands it its flag. Also public: :func:`stats`,
:func:`load_stats`, ``SPEC``.

Design: docs/design/grad_clip.md
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

import torch
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from . import _dist, _options, _run, _step
from ._counters import DeviceCounters
from ._log import logger
from ._options import Option, flag
from ._registry import PatchSpec, Site, register

class _Counts:
    """The clip's counts in the run: only the non-finite flag lives on the device; the
    other counts are known on the host."""

    def __init__(self) -> None:
        self.device = DeviceCounters("nonfinite_norms")
        self.host = {"calls": 0, "unscaled_first": 0, "scaled_clips": 0}


def _counts() -> _Counts:
    return _run.current().part(_Counts)


def unscale_first() -> bool:
    """Whether ``max_norm`` limits the true gradients of a pending SafeGradScaler."""
    return _options.current().clip_unscale_first


def _warn_scaled_once(max_norm: float) -> None:
    if not _run.current().first_time("grad_clip.scaled"):
        return
    logger.warning(
        "grad_clip: clip_grad_norm_(max_norm=%g) ran on gradients a SafeGradScaler has not "
        "unscaled yet (they are the true gradients times the loss scale). They are clipped as "
        "torch clips them: max_norm is compared with the scaled norm. If you passed "
        "max_norm * scaler.get_scale(), that is what you want and nothing needs doing. If "
        "max_norm is meant for the true gradients, call scaler.unscale_(optimizer) before "
        "clip_grad_norm_, or set TRAINING_PATCHES_CLIP_UNSCALE_FIRST=1 (then max_norm always "
        "limits the true gradients). Logged once per process; stats()['grad_clip']"
        "['scaled_clips'] counts these calls.", max_norm)


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """The full value of a DTensor as a plain tensor: its local copy when replicated (no
    communication), else ``full_tensor()`` (e.g. a partial norm); a plain tensor as it is."""
    if not _dist.is_dtensor(tensor):
        return tensor
    from torch.distributed.tensor import Replicate  # lazy: heavy module, only for a DTensor
    if all(isinstance(placement, Replicate) for placement in tensor.placements):
        return tensor.to_local()
    return tensor.full_tensor()


def _true_norm(unscaled: list[torch.Tensor], scaled: list[torch.Tensor],
               scale: torch.Tensor, norm_type: float, foreach: bool | None) -> torch.Tensor:
    """The total norm of the true gradients: the scaled ones divided by ``scale``."""
    total = get_total_norm(scaled, norm_type, False, foreach)
    total = total / scale.to(total.device, non_blocking=True)
    if unscaled:
        # The p-norm of the two partial p-norms is the p-norm of all the gradients.
        part = get_total_norm(unscaled, norm_type, False, foreach)
        total = get_total_norm([part, total.to(part.device)], norm_type, False, foreach)
    return total


def safe_clip_grad_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float,
                         norm_type: float = 2.0, foreach: bool | None = None) -> torch.Tensor:
    """Clip gradients by their total norm and return it; a non-finite norm clips nothing.

    With the ``clip_unscale_first`` option on, gradients a SafeGradScaler has not
    unscaled yet count by their true (unscaled) size: see docs/design/grad_clip.md.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    with_grad = [p for p in params if p.grad is not None]
    if not with_grad:
        return torch.tensor(0.0)
    counts = _counts()
    with torch.no_grad():
        scaler = _step.context().pending_scaler()
        done = scaler.unscaled_param_ids() if scaler is not None else frozenset()
        still_scaled = [] if scaler is None else [p for p in with_grad if id(p) not in done]
        if still_scaled and unscale_first():
            unscaled = [p.grad for p in with_grad if id(p) in done]
            total = _true_norm(unscaled, [p.grad for p in still_scaled], scaler.scale_tensor(),
                               norm_type, foreach)
            counts.host["unscaled_first"] += 1
        else:
            total = get_total_norm([p.grad for p in with_grad], norm_type, False, foreach)
            if still_scaled:
                counts.host["scaled_clips"] += 1
                _warn_scaled_once(max_norm)
        nonfinite = ~torch.isfinite(total)
        # A zero norm gives a clip coefficient of 1: non-finite gradients stay as they are
        # for the scaler or the NaN guard to skip, finite ones are not destroyed.
        clip_grads_with_norm_(with_grad, max_norm, total.masked_fill(nonfinite, 0.0), foreach)
        counts.device.add("nonfinite_norms", _plain(nonfinite))
    counts.host["calls"] += 1
    # The NaN guard takes this flag instead of reducing the same gradients again.
    context = _step.context()
    context.put_clip([p.grad for p in with_grad], nonfinite)
    context.mark("clip")
    return total


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
    counts = _counts()
    return {**counts.host, **counts.device.read()}


def load_stats(counts: dict[str, int]) -> None:
    """Restore counts saved from :func:`stats` (e.g. on resume)."""
    mine = _counts()
    mine.device.load(counts)
    for name in mine.host:
        mine.host[name] = int(counts.get(name, 0))


def _describe(options: Any) -> str:
    text = "clip_grad_norm_ leaves gradients intact on a non-finite norm"
    if getattr(options, "clip_unscale_first", False):
        text += "; max_norm limits the true gradients before a SafeGradScaler unscales them"
    return text


SPEC = register(PatchSpec(
    name="grad_clip",
    describe=_describe,
    sites=(
        Site("torch.nn.utils", "clip_grad_norm_", _make, sweep=True),
        Site("torch.nn.utils.clip_grad", "clip_grad_norm_", _make),
    ),
    stats=stats,
    load_stats=load_stats,
    options=(
        Option("clip_unscale_first", flag, False,
               "1 or 0 (1: clip_grad_norm_ on gradients a SafeGradScaler has not unscaled yet "
               "treats max_norm as a limit on the true gradients; 0: clips them as torch does)",
               "1: `clip_grad_norm_` on gradients a SafeGradScaler has not unscaled treats "
               "`max_norm` as a limit on the true gradients (for trainers that forgot "
               "`unscale_`)"),
    ),
))
