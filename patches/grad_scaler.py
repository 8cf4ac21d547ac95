"""``grad_scaler``: SafeGradScaler wherever a trainer builds a GradScaler.

fp16 on a T4 overflows, and torch's GradScaler starts at 65536 and keeps no record of what it
skipped. SafeGradScaler is a ``torch.amp.GradScaler`` (``isinstance`` holds, its state loads
into a plain one) that starts at ``init_scale`` 1024 and grows every ``growth_interval`` 100
steps; counts steps, skips and the skip streak on the device (no sync beyond the one torch's
``_maybe_opt_step`` makes, whose answer it reuses); logs each scale change, a stats line every
``log_interval`` steps and a warning below scale 1.0; never goes below ``min_scale`` and raises
:class:`LossScaleFloorError` after ``max_floor_skips`` skipped steps in a row there; can back
off only after ``hysteresis`` overflows in a row (as DeepSpeed and Megatron do; 1 follows
torch exactly); makes every rank of a process group skip the same steps (under DDP with no
collective of its own, ranks that an edit on one rank made decide differently raising
:class:`RanksDivergedError`; docs/design/step.md). FSDP's ``ShardedGradScaler`` becomes
:func:`sharded_scaler_class`. It decides before ``optimizer.step()``: no step pipeline stage.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from collections import defaultdict
from collections.abc import Set
from typing import Any

import torch
import torch.amp.grad_scaler as _torch_grad_scaler
import torch.distributed as dist
from torch.amp.grad_scaler import GradScaler as _TorchGradScaler

from . import _ddp, _dist, _options, _run, _step
from ._counters import DeviceCounters
from ._log import info, logger
from ._options import (FLOAT32_MAX, FLOAT32_TINY, INT32_MAX, INT64_MAX, ConfigError, Option,
                       flag, positive_float, positive_int)
from ._registry import PatchSpec, Site, active, register
from .autocast import CudaGradScaler

# The private torch names SafeGradScaler relies on. A torch that lacks one leaves only
# this patch off (loudly, see ``_missing_private_names``), never ``import patches``.
_PRIVATE = (
    ("torch.amp.grad_scaler", "_refresh_per_optimizer_state"),
    ("torch", "_amp_update_scale_"),
    ("torch.amp.GradScaler", "_maybe_opt_step"),
    ("torch.amp.GradScaler", "_check_scale_growth_tracker"),
    ("torch.amp.grad_scaler", "OptState"),
)


def _missing_private_names() -> list[str]:
    owners = {"torch.amp.grad_scaler": _torch_grad_scaler, "torch": torch,
              "torch.amp.GradScaler": _TorchGradScaler}
    return [f"{owner}.{name}" for owner, name in _PRIVATE if not hasattr(owners[owner], name)]

STATE_KEY = "training_patches"
# One JSON line per overflow and per scale change (what ``training-patches report`` plots),
# written from the host copy of the scale: no sync.
SCALE_FILE = _run.SCALE_FILE


class LossScaleFloorError(FloatingPointError):
    """Gradients stayed non-finite with the loss scale already at its floor."""


class RanksDivergedError(FloatingPointError):
    """Under DDP the ranks took different skip decisions at the last step (a gradient
    changed on one rank after DDP's reduction): the replicas differ."""


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _warn_at_caller(caught: list[warnings.WarningMessage]) -> None:
    """Re-issue torch's warnings (``GradScaler is enabled, but CUDA is not available``) at
    the user's line: torch's ``stacklevel=2`` would name our ``__init__``, which only the
    patch put between the user and torch."""
    frame: Any = sys._getframe(1)  # up to the first frame outside this package
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(
            _PACKAGE_DIR):
        frame = frame.f_back
    for w in caught:
        if frame is None:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            continue
        module_globals = frame.f_globals
        where = dict(module=module_globals.get("__name__"),
                     registry=module_globals.setdefault("__warningregistry__", {}))
        try:
            warnings.warn_explicit(w.message, w.category, frame.f_code.co_filename,
                                   frame.f_lineno, module_globals=module_globals, **where)
        except ImportError:
            # module_globals shows the line's source through the module's loader: a program
            # given as text (``python -c``, stdin, the REPL) has none that can: warn without
            warnings.warn_explicit(w.message, w.category, frame.f_code.co_filename,
                                   frame.f_lineno, **where)


class _ScalerType(type):
    """Shows a scaler class as what the user built: ``SafeGradScaler(torch.cuda.amp.GradScaler)``
    (the class the patch put at that name), not the name of our internal subclass."""

    def __repr__(cls) -> str:
        return f"<class '{cls.__module__}.SafeGradScaler({cls._tp_built_as})'>"


class SafeGradScaler(_TorchGradScaler, metaclass=_ScalerType):
    """A ``torch.amp.GradScaler`` with safe defaults, skip counters and a floor.

    Arguments left as ``None`` come from the options (``TRAINING_PATCHES_*``
    variables or ``patches.advanced.apply(...)``); arguments a trainer passes win.
    ``repr()`` of the class and of a scaler names the torch class the user built
    (``SafeGradScaler(torch.cuda.amp.GradScaler)``).
    """

    # The torch class the user's code asked for, which this class stands in for.
    _tp_built_as = "torch.amp.GradScaler"
    # Whether the torch class already all-reduces the overflow flag (FSDP's does).
    _tp_agrees_itself = False

    def __init__(self, device: str = "cuda", init_scale: float | None = None,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int | None = None, enabled: bool = True, *,
                 hysteresis: int | None = None, min_scale: float | None = None,
                 max_floor_skips: int | None = None, log_interval: int | None = None) -> None:
        opts = _options.current()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            super().__init__(
                device, init_scale=opts.init_scale if init_scale is None else init_scale,
                growth_factor=growth_factor, backoff_factor=backoff_factor,
                growth_interval=(opts.growth_interval if growth_interval is None
                                 else growth_interval), enabled=enabled)
        _warn_at_caller(caught)
        self.hysteresis = opts.hysteresis if hysteresis is None else int(hysteresis)
        self.min_scale = opts.min_scale if min_scale is None else float(min_scale)
        self.max_floor_skips = opts.max_floor_skips if max_floor_skips is None else max_floor_skips
        self.log_interval = opts.log_interval if log_interval is None else log_interval
        if self.hysteresis < 1:
            raise ValueError(
                f"SafeGradScaler: hysteresis must be at least 1, got {self.hysteresis}")
        self._tp_counts = DeviceCounters("steps", "skipped", "consecutive_skips")
        self._tp_hysteresis_left: torch.Tensor | None = None
        self._tp_init_hysteresis_left = self.hysteresis
        self._tp_unscaled: set[int] = set()  # ids of parameters unscaled this iteration
        self._tp_found_host: list[bool] = []  # answers of the sync torch already makes
        self._tp_iteration = 0
        self._tp_last_loss: torch.Tensor | None = None  # read only when a step overflowed
        self._tp_floor_skips = 0
        self._tp_last_good_step = 0
        # DDP: id(optimizer) -> the carrier's reduction count at its last unscale, and
        # whether the ranks' previous decisions differed (a device flag, read with the next)
        self._tp_reduced_seen: dict[int, int] = {}
        self._tp_diverged: dict[int, torch.Tensor] = {}
        self._tp_diverged_unread: torch.Tensor | None = None  # fused steps: read when logging
        # Host copy of scale, growth tracker, skip streak and hysteresis, advanced from the
        # overflow flag torch already syncs; None while unknown (then resynced when logging).
        self._tp_mirror: dict[str, Any] | None = self._fresh_mirror()
        if self._enabled:
            info("SafeGradScaler on %s: init_scale=%g, growth_interval=%d, hysteresis=%d, "
                 "min_scale=%g", device, self._init_scale, self._growth_interval,
                 self.hysteresis, self.min_scale)

    def _fresh_mirror(self) -> dict[str, Any] | None:
        if not self._enabled:
            return None
        return {"scale": float(self._init_scale), "tracker": int(self._init_growth_tracker),
                "streak": self._tp_counts.read()["consecutive_skips"],
                "left": self._tp_init_hysteresis_left}

    # -- the training step -------------------------------------------------

    def scale(self, outputs: Any) -> Any:  # type: ignore[override]
        if self._enabled:
            _step.context().scaler_scaled(self)
            if isinstance(outputs, torch.Tensor) and outputs.numel() == 1:
                self._tp_last_loss = outputs.detach()
        return super().scale(outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)
        if self._enabled:
            self._tp_unscaled.update(
                id(p) for group in optimizer.param_groups for p in group["params"])
            _step.context().mark("unscale")

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        # A fused optimizer's path: the flags only (its kernel unscales and decides).
        found = super()._check_inf_per_device(optimizer)
        _step.context().mark("unscale")
        return found

    def unscaled_param_ids(self) -> Set[int]:
        """ids of the parameters whose gradients ``unscale_`` divided by the scale since the
        last ``update()`` (read-only: the scaler's own set)."""
        return self._tp_unscaled

    def scale_tensor(self) -> torch.Tensor:
        """The loss scale as the device tensor the gradients were multiplied by (no sync)."""
        return self._check_scale_growth_tracker("scale_tensor")[0]

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor,
                        found_inf: torch.Tensor, allow_fp16: bool
                        ) -> dict[torch.device, torch.Tensor]:
        # Both torch paths come here: unscale_ (explicit, or inside step) and the fused
        # optimizers' _check_inf_per_device.
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        if not self._tp_agrees_itself and _dist.collectives():
            self._tp_agree(optimizer, per_device, found_inf)
        return per_device

    def _tp_agree(self, optimizer: torch.optim.Optimizer,
                  per_device: dict[torch.device, torch.Tensor], like: torch.Tensor) -> None:
        """Every rank's overflow flags for ``optimizer`` set alike: no collective where DDP
        reduced every gradient it holds since its last unscale (this rank's flag rides the
        next reduction), else one all-reduce (docs/design/step.md, "Under DDP")."""
        carrier = _ddp.use_for_scaler(optimizer)
        if carrier is None:
            _agree_found_inf(per_device, like)
            return
        key = id(optimizer)
        # None at its first unscale: what made these gradients is unknown, so agree
        seen, self._tp_reduced_seen[key] = self._tp_reduced_seen.get(key), carrier.reductions
        carrier.fresh = False  # a decision since the reduction (the guard's test too)
        if seen is not None and carrier.reductions > seen and carrier.covers(optimizer):
            self._tp_diverged[key] = carrier.diverged()
            decided = _found_on_rank(per_device, like)
        else:
            decided = _agree_found_inf(per_device, like)
        carrier.last_skip = decided  # this rank's decision: the next reduction carries it

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if self._enabled and not any(p.grad is not None for group in optimizer.param_groups
                                     for p in group["params"]):
            # Every micro-batch of this step was left out (non-finite losses): torch's
            # GradScaler would assert "No inf checks were recorded". Count it as skipped.
            state = self._per_optimizer_states[id(optimizer)]
            if not state["found_inf_per_device"]:
                scale = self._check_scale_growth_tracker("step")[0]
                state["found_inf_per_device"][scale.device] = torch.ones(
                    (), dtype=torch.float32, device=scale.device)
                if not self._tp_agrees_itself and _dist.collectives():
                    # the peers' unscale may all-reduce their flags: meet them there
                    self._tp_agree(optimizer, state["found_inf_per_device"], scale)
                state["stage"] = _torch_grad_scaler.OptState.STEPPED
                self._tp_found_host.append(True)
                _step.context().mark("decide")
                _step.context().mark("skip")
                return None
        result = super().step(optimizer, *args, **kwargs)
        if self._enabled and getattr(optimizer, "_step_supports_amp_scaling", False):
            # A fused optimizer's kernel read found_inf and stepped or skipped on the device:
            # no host decision to mark, only that the step ran (the pipeline marks it).
            if not _step.pipeline_on():
                _step.context().mark("step")
            diverged = self._tp_diverged.pop(id(optimizer), None)
            if diverged is not None:  # no host read per step: read with the next stats line
                unread = self._tp_diverged_unread
                self._tp_diverged_unread = diverged if unread is None else unread | diverged
        return result

    def _maybe_opt_step(self, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any],
                        *args: Any, **kwargs: Any) -> Any:
        # The same single sync torch makes; its answer also feeds the host mirror.
        flags = list(optimizer_state["found_inf_per_device"].values())
        diverged = self._tp_diverged.pop(id(optimizer), None)
        if diverged is None:
            found = bool(sum(v.item() for v in flags))
        else:  # DDP, flags carried: read with the first device's flag, no sync of its own
            first, split = torch.stack([flags[0].reshape(()).float(),
                                        diverged.to(flags[0].device).float()]).tolist()
            if split:
                _raise_diverged()
            found = bool(first + sum(v.item() for v in flags[1:]))
        self._tp_found_host.append(found)
        context = _step.context()
        context.mark("decide")
        if found:
            context.mark("skip")
            return None
        if not _step.pipeline_on():
            context.mark("step")  # else the pipeline marks it, after its stages before it
        context.scaler_stepping = True  # the NaN guard leaves this checked step alone
        try:
            return optimizer.step(*args, **kwargs)
        finally:
            context.scaler_stepping = False

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        if not self._enabled:
            return
        self._tp_unscaled.clear()
        _step.context().scaler_updated(self)  # no longer pending; the iteration's listeners
        if new_scale is not None:
            super().update(new_scale)
            self._tp_mirror = None
            self._tp_found_host.clear()
            _step.context().mark("record")
            return
        scale, tracker = self._check_scale_growth_tracker("update")
        found_infs = [found_inf.to(device=scale.device, non_blocking=True)
                      for state in self._per_optimizer_states.values()
                      for found_inf in state["found_inf_per_device"].values()]
        if not found_infs:
            raise AssertionError("No inf checks were recorded prior to update.")
        found = found_infs[0].clone()
        for extra in found_infs[1:]:
            found += extra
        stepped = len(self._per_optimizer_states)
        host_found = any(self._tp_found_host) if len(self._tp_found_host) == stepped else None
        self._tp_found_host.clear()
        self._per_optimizer_states = defaultdict(_torch_grad_scaler._refresh_per_optimizer_state)

        if self._tp_mirror is None and host_found is not None:
            self._tp_mirror = self._read_device_state()  # only after a stretch it could not follow
        self._update_scale(scale, tracker, found)
        self._tp_counts.record_step(found > 0)
        self._tp_iteration += 1
        self._after_update(host_found)
        _step.context().mark("record")

    def _update_scale(self, scale: torch.Tensor, tracker: torch.Tensor,
                      found: torch.Tensor) -> None:
        if self.hysteresis == 1:
            torch._amp_update_scale_(scale, tracker, found, self._growth_factor,
                                     self._backoff_factor, self._growth_interval)
        else:
            if self._tp_hysteresis_left is None:
                self._tp_hysteresis_left = torch.full(
                    (), self._tp_init_hysteresis_left, dtype=torch.int32, device=scale.device)
            bad = found > 0
            left = torch.where(bad, self._tp_hysteresis_left - 1,
                               torch.full_like(self._tp_hysteresis_left, self.hysteresis))
            backoff = bad & (left <= 0)
            successful = torch.where(bad, torch.zeros_like(tracker), tracker + 1)
            reset = (~bad) & (successful >= self._growth_interval)
            grown = scale * self._growth_factor
            grow = reset & torch.isfinite(grown)
            scale.copy_(torch.where(backoff, scale * self._backoff_factor,
                                    torch.where(grow, grown, scale)))
            tracker.copy_(torch.where(reset, torch.zeros_like(tracker), successful))
            self._tp_hysteresis_left.copy_(left.clamp(min=0))
        scale.clamp_(min=self.min_scale)

    # -- host side: logging and escalation, no extra sync -----------------

    def _read_device_state(self) -> dict[str, Any]:
        """Everything on the device, copied to the host (the only sync we add, when logging)."""
        counts = self._tp_counts.read()
        left = (self._tp_init_hysteresis_left if self._tp_hysteresis_left is None
                else int(self._tp_hysteresis_left.item()))
        return {"scale": self.get_scale(), "tracker": self._get_growth_tracker(),
                "streak": counts["consecutive_skips"], "left": left, **counts}

    def _mirror_step(self, mirror: dict[str, Any], found: bool) -> None:
        """Replay ``_update_scale`` on the host from the already-synced overflow flag."""
        if found:
            mirror["streak"] += 1
            mirror["tracker"] = 0
            mirror["left"] = max(mirror["left"] - 1, 0) if self.hysteresis > 1 else 0
            if self.hysteresis == 1 or mirror["left"] <= 0:
                mirror["scale"] = max(mirror["scale"] * self._backoff_factor, self.min_scale)
        else:
            mirror["streak"] = 0
            mirror["left"] = self.hysteresis
            mirror["tracker"] += 1
            if mirror["tracker"] >= self._growth_interval:
                mirror["tracker"] = 0
                grown = mirror["scale"] * self._growth_factor
                if math.isfinite(grown):
                    mirror["scale"] = grown

    def _after_update(self, host_found: bool | None) -> None:
        step = self._tp_iteration
        mirror = self._tp_mirror
        if host_found is None or mirror is None:
            self._tp_mirror = None  # unknown on the host (fused optimizer): resync when logging
        else:
            before = mirror["scale"]
            at_floor = before <= self.min_scale
            self._mirror_step(mirror, host_found)
            if not host_found:
                self._tp_last_good_step = step
            self._report_scale_change(step, before, mirror["scale"], host_found)
            self._tp_floor_skips = self._tp_floor_skips + 1 if (host_found and at_floor) else 0
            if self._tp_floor_skips >= self.max_floor_skips:
                self._raise_floor(step, mirror["streak"])
        if step % self.log_interval == 0:
            self._log_stats(step)

    def _report_scale_change(self, step: int, before: float, after: float, found: bool) -> None:
        if found or after != before:
            record = {"step": step, "trainer_step": _run.current().trainer_step,
                      "scale_before": before, "scale": after, "overflow": found}
            if found:  # was it the loss itself (a NaN batch) or only its gradients?
                loss = self._tp_last_loss
                record["loss"] = float(loss.float()) if loss is not None else None
                record["samples"] = list(_run.current().batch_ids)
            _run.append_jsonl(SCALE_FILE, record)
        self._tp_last_loss = None
        if after == before:
            return
        why = "overflow, step skipped" if found else f"{self._growth_interval} clean steps"
        info("SafeGradScaler: scale %g -> %g at step %d (%s)", before, after, step, why)
        if after < 1.0 <= before:
            logger.warning(
                "SafeGradScaler: loss scale fell below 1.0 (%g) at step %d. Gradients overflow "
                "even unscaled: this is numerical instability, not fp16 range. Consider a lower "
                "learning rate, checking the data, or training in fp32/bf16.", after, step)

    def _log_stats(self, step: int) -> None:
        unread, self._tp_diverged_unread = self._tp_diverged_unread, None
        if unread is not None and bool(unread):  # fused steps under DDP (one read)
            _raise_diverged()
        state = self._read_device_state()
        self._tp_mirror = {k: state[k] for k in ("scale", "tracker", "streak", "left")}
        share = 100.0 * state["skipped"] / max(state["steps"], 1)
        info("SafeGradScaler stats @ step %d: scale %g, skipped %d of %d steps (%.2f%%), "
             "current skip streak %d", step, state["scale"], state["skipped"], state["steps"],
             share, state["streak"])
        if state["scale"] <= self.min_scale and state["streak"] >= self.max_floor_skips:
            self._raise_floor(step, state["streak"])

    def _raise_floor(self, step: int, streak: int) -> None:
        raise LossScaleFloorError(
            f"SafeGradScaler: at step {step} the gradients have been non-finite for {streak} "
            f"consecutive steps, the last {self._tp_floor_skips or streak} of them with the loss "
            f"scale already at its floor ({self.min_scale:g}); the last step that trained was "
            f"step {self._tp_last_good_step}. Lowering the scale no longer helps: the loss or the "
            f"model produces NaN/Inf by itself. Try: a lower learning rate; checking the samples "
            f"of these batches; fp32 or bf16 instead of fp16; "
            f"TRAINING_PATCHES_ANOMALY=1 to name the operation. To allow longer streaks set "
            f"TRAINING_PATCHES_MAX_FLOOR_SKIPS (now {self.max_floor_skips})."
        )

    # -- state -------------------------------------------------------------

    def __repr__(self) -> str:
        state = (f"scale={self.get_scale():g}, growth_interval={self._growth_interval}"
                 if self._enabled else "enabled=False")
        return f"SafeGradScaler({self._tp_built_as}, device={self._device!r}, {state})"

    def stats(self) -> dict[str, float]:
        """Counters and scale as plain numbers (one host read)."""
        if not self._enabled:
            return {"enabled": 0}
        state = self._read_device_state()
        return {"enabled": 1, "scale": state["scale"], "steps": state["steps"],
                "skipped": state["skipped"], "consecutive_skips": state["streak"]}

    def state_dict(self) -> dict[str, Any]:
        """torch's keys, plus ours under ``"training_patches"`` (a plain GradScaler ignores
        them)."""
        state = super().state_dict()
        if state:
            device = self._read_device_state()
            state[STATE_KEY] = {
                "steps": device["steps"], "skipped": device["skipped"],
                "consecutive_skips": device["streak"], "hysteresis_left": device["left"],
                "iteration": self._tp_iteration,
            }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a SafeGradScaler's or a plain GradScaler's state."""
        super().load_state_dict(state_dict)
        if not self._enabled:
            return
        ours = state_dict.get(STATE_KEY, {})
        self._tp_counts.load(ours)
        self._tp_iteration = int(ours.get("iteration", ours.get("steps", 0)))
        left = int(ours.get("hysteresis_left", self.hysteresis))
        self._tp_init_hysteresis_left = left
        if self._tp_hysteresis_left is not None:
            self._tp_hysteresis_left.fill_(left)
        self._tp_mirror = self._fresh_mirror()
        self._tp_floor_skips = 0

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_tp_hysteresis_left"] = None
        return state


def _found_on_rank(per_device: dict[torch.device, torch.Tensor],
                   like: torch.Tensor) -> torch.Tensor:
    """Whether this rank overflowed on any device (a scalar on ``like``'s device)."""
    local = like.new_zeros((), dtype=torch.float32)
    for flag in per_device.values():
        local = torch.maximum(local, flag.to(local.device, non_blocking=True).reshape(()))
    return local


def _agree_found_inf(per_device: dict[torch.device, torch.Tensor],
                     like: torch.Tensor) -> torch.Tensor:
    """Every rank's overflow flags set to whether any rank overflowed: one all-reduce of
    one scalar (also from a rank with no gradient on any device, so no rank waits alone).
    Returns the agreed flag."""
    local = _found_on_rank(per_device, like)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    for flag in per_device.values():
        flag.copy_(local.to(flag.device, non_blocking=True).reshape(flag.shape))
    return local


def _raise_diverged() -> None:
    raise RanksDivergedError(
        f"SafeGradScaler: the ranks did not all take the same decision at the last optimizer "
        f"step: some skipped it for an overflow and some took it, so the DDP replicas (and "
        f"their loss scales) now differ. Under DDP every rank's gradients are equal once "
        f"reduced, so the scaler's overflow check agrees with no collective of its own; ranks "
        f"can only decide differently when code on one rank changes its gradients AFTER the "
        f"reduction (an edit of p.grad between backward() and scaler.step() on one rank). "
        f"Change gradients before the reduction (a tensor hook, or the loss), or the same way "
        f"on every rank. Seen on rank {_dist.rank()} of {_dist.world_size()}; every rank "
        f"stops here.")


class CudaSafeGradScaler(SafeGradScaler):
    """SafeGradScaler with the signature of the deprecated ``torch.cuda.amp.GradScaler``."""

    _tp_built_as = "torch.cuda.amp.GradScaler"

    def __init__(self, init_scale: float | None = None, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int | None = None,
                 enabled: bool = True, **kwargs: Any) -> None:
        super().__init__("cuda", init_scale, growth_factor, backoff_factor, growth_interval,
                         enabled, **kwargs)


def cuda_scaler_class(original: type) -> type:
    """What the deprecated ``torch.cuda.amp.GradScaler`` is: CudaSafeGradScaler while this
    patch is applied, else (``autocast`` alone) torch's modern class under the old signature."""
    return CudaSafeGradScaler if active("grad_scaler") else CudaGradScaler


_sharded_classes: dict[int, type] = {}


def sharded_scaler_class(original: type) -> type:
    """SafeGradScaler's behaviour on FSDP's ``ShardedGradScaler`` (``original``).

    The MRO is (SafeShardedGradScaler, SafeGradScaler, ShardedGradScaler, GradScaler):
    ``isinstance(scaler, ShardedGradScaler)`` holds, its ``unscale_`` (sharded gradients,
    the overflow flag all-reduced over ``process_group``) runs, and ``update`` is
    SafeGradScaler's. The signature is ShardedGradScaler's (``backoff_factor`` before
    ``growth_factor``, ``process_group``).
    """
    made = _sharded_classes.get(id(original))
    if made is not None:
        return made
    class SafeShardedGradScaler(SafeGradScaler, original):  # type: ignore[misc, valid-type]
        __doc__ = (f"SafeGradScaler's defaults, counters and floor on "
                   f"{original.__module__}.{original.__qualname__}.")
        _tp_built_as = "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler"
        _tp_agrees_itself = True  # its unscale_ all-reduces the flag over process_group

        def __init__(self, device: str = "cuda", init_scale: float | None = None,
                     backoff_factor: float = 0.5, growth_factor: float = 2.0,
                     growth_interval: int | None = None, enabled: bool = True,
                     process_group: Any = dist.group.WORLD, **kwargs: Any) -> None:
            SafeGradScaler.__init__(self, device, init_scale, growth_factor, backoff_factor,
                                    growth_interval, enabled, **kwargs)
            if self._enabled:  # ShardedGradScaler.__init__ (via super) set the default
                self.process_group = process_group

    SafeShardedGradScaler.__module__ = __name__
    # SafeGradScaler is a base by design; what this layer wraps is FSDP's class alone.
    SafeShardedGradScaler.__wrapped__ = original  # type: ignore[attr-defined]
    SafeShardedGradScaler.__qualname__ = "SafeShardedGradScaler"
    _sharded_classes[id(original)] = SafeShardedGradScaler
    return SafeShardedGradScaler


def stats() -> dict[str, float]:
    scaler = _step.context().latest_scaler()
    return scaler.stats() if scaler is not None else {}


_FLOAT32_SCALE = "the loss scale is a float32 tensor: finite, and never rounded to 0"
_INT64_COUNT = "steps are counted in int64"


def _check_options(opts: _options.Options, where: Any) -> None:
    if opts.min_scale > opts.init_scale:
        raise ConfigError(
            f"training-patches: {where('min_scale')} is {opts.min_scale!r}, above "
            f"{where('init_scale')} {opts.init_scale!r}. Expected the loss-scale floor at or "
            f"below the initial scale (the defaults are 6.1e-05 and 1024). Lower the floor or "
            f"raise the initial scale.")


SPEC = register(PatchSpec(
    name="grad_scaler",
    describe=lambda o: (
        f"SafeGradScaler(init_scale={o.init_scale:g}, growth_interval={o.growth_interval}, "
        f"hysteresis={o.hysteresis}) wherever a GradScaler or FSDP's ShardedGradScaler is "
        f"built"),
    sites=(
        Site("torch", "GradScaler", lambda original: SafeGradScaler, sweep=True),
        Site("torch.amp", "GradScaler", lambda original: SafeGradScaler),
        # this patch's and autocast's: made again when either comes or goes
        Site("torch.cuda.amp", "GradScaler", cuda_scaler_class, sweep=True,
             patch=("grad_scaler", "autocast"),
             lost={"grad_scaler": "torch.cuda.amp.GradScaler builds torch's GradScaler "
                                  "(initial scale 65536, no skip counters, no floor)",
                   "autocast": "torch.cuda.amp.GradScaler warns (FutureWarning) at each "
                               "use"}),
        # FSDP's scaler (torch.distributed.fsdp does not re-export it); sweep: a trainer's
        # `from ...sharded_grad_scaler import ShardedGradScaler` made before apply().
        Site("torch.distributed.fsdp.sharded_grad_scaler", "ShardedGradScaler",
             sharded_scaler_class, sweep=True,
             lost="FSDP's ShardedGradScaler keeps torch's init_scale 65536, no skip counters "
                  "and no floor"),
    ),
    requires=_missing_private_names,
    stats=stats,
    options=(
        Option("init_scale", positive_float, 1024.0, "a number greater than 0, e.g. 1024",
               "first loss scale of a SafeGradScaler", shown_default="1024",
               low=FLOAT32_TINY, high=FLOAT32_MAX, bound_why=_FLOAT32_SCALE),
        Option("growth_interval", positive_int, 100,
               "a whole number of steps of at least 1, e.g. 100",
               "clean steps before the scale doubles", low=1, high=INT32_MAX,
               bound_why="torch counts the clean steps in an int32 tensor"),
        Option("log_interval", positive_int, 500,
               "a whole number of steps of at least 1, e.g. 500", "steps between stats lines",
               also=("nan_guard",), low=1, high=INT64_MAX, bound_why=_INT64_COUNT),
        Option("hysteresis", positive_int, 1,
               "a whole number of at least 1 (1 = back off on every overflow)",
               "back off only after this many consecutive overflows", low=1, high=INT32_MAX,
               bound_why="the overflows left before a back-off are counted in an int32 tensor"),
        Option("min_scale", positive_float, 2.0 ** -14, "a number greater than 0, e.g. 6.1e-05",
               "the floor of the loss scale (at most `init_scale`)", shown_default="2^-14",
               low=FLOAT32_TINY, high=FLOAT32_MAX, bound_why=_FLOAT32_SCALE),
        Option("max_floor_skips", positive_int, 10,
               "a whole number of steps of at least 1, e.g. 10",
               "consecutive skipped steps at the floor before the run stops", low=1,
               high=INT64_MAX, bound_why=_INT64_COUNT),
    ),
    check=_check_options,
))
