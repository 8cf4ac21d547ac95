"""DDP's own gradient reduction carrying the patches' skip flags (issue 41): one communication
hook per ``DistributedDataParallel`` module, shared by nan_guard and grad_scaler, reduces every
bucket as DDP's default does and appends :data:`CARRIED` numbers to one (the smallest of the
last reduction), so a patched DDP step makes exactly the collectives of an unpatched one. It
runs inside the backward's reduction, before the optimizer step: no stage of the step pipeline.
Public to the patches: :class:`Carrier`, :func:`carrier_of`, :func:`known_carrier`,
:func:`carry_loss_flags`, :func:`use_for_scaler`.

Design: docs/design/nan_guard.md ("No collective of its own under DDP") and
docs/design/step.md ("Under DDP").
"""

from __future__ import annotations

import atexit
import threading
import weakref
from typing import Any, Callable

import torch

from . import _run
from ._log import logger

CARRIED = 4  # loss bad (non-finite or spike), loss non-finite, kept a micro-batch, last skip

# nan_guard's flags of the reduction under way, (bad, nonfinite, kept), while it is applied
LossFlags = Callable[[torch.device], "tuple[torch.Tensor, torch.Tensor, bool]"]
_loss_flags: LossFlags | None = None


def carry_loss_flags(flags: LossFlags | None) -> None:
    """nan_guard's loss flags for the hook when applied; None when reverted (DDP cannot take
    a hook back: one no SafeGradScaler uses then reduces plainly)."""
    global _loss_flags
    _loss_flags = flags


class Carrier:
    """One DDP module's communication hook state: the flags its last reduction carried."""

    def __init__(self, ddp: Any) -> None:
        self.group = ddp.process_group
        # ids of the parameters DDP reduces, read from its buckets at the first reduction
        self.reduced: frozenset[int] | None = None
        self._bucketed: set[int] = set()
        self.received: torch.Tensor | None = None  # the sums over the ranks
        self.fresh = False  # nan_guard: a reduction carried flags since its last decision
        self.last_skip: torch.Tensor | None = None  # this rank's last decision (device)
        self.world = 1
        self.reductions = 0  # complete reductions that carried the flags (SafeGradScaler's)
        self.carrying_now = False  # the reduction under way is to carry them
        # the bucket that carries them: the smallest of the last reduction (the same on every
        # rank), so the copy costs nothing; bucket 0 (maybe the whole text head) at the first
        self.carry_at = 0
        self.carried_now = False  # the reduction under way carried them (at carry_at)
        self._sizes: dict[int, int] = {}  # this reduction's bucket sizes, by index
        self.for_scaler = False  # sticky: every rank carries alike for the module's life

    def covers(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether DDP reduces every parameter of ``optimizer`` that takes a gradient
        (structure only: the same on every rank)."""
        reduced = self.reduced
        return reduced is not None and all(
            id(p) in reduced for group in optimizer.param_groups for p in group["params"]
            if p.requires_grad)

    def diverged(self) -> torch.Tensor:
        """Whether the ranks' last decisions, carried by the last reduction, differ (some
        skipped, some stepped): a device flag, read with the next decision."""
        last = self.received[3]  # type: ignore[index]
        return (last > 0) & (last < self.world - 0.5)


class _Then:
    """A reduction's ``.then`` callback that counts itself until it is freed: torch frees it
    on the communication thread, and a free waiting for the GIL during finalization aborts
    the process ("terminate called without an active exception"), so :func:`_drain_at_exit`
    waits for every one first."""

    __slots__ = ("_call",)

    def __init__(self, call: Callable[[Any], Any]) -> None:
        self._call = call
        with _live_lock:
            global _live
            _live += 1

    def __call__(self, fut: Any) -> Any:
        return self._call(fut)

    def __del__(self) -> None:
        with _live_lock:
            global _live
            _live -= 1
            if _live == 0:
                _live_lock.notify_all()


_live = 0  # _Then callbacks handed to futures and not yet freed
_live_lock = threading.Condition()
EXIT_WAIT_S = 5.0  # a reduction that never completes (a dead peer) must not hold the exit


def _drain_at_exit() -> None:
    with _live_lock:  # Condition.wait lets go of the GIL: the comm threads can free theirs
        _live_lock.wait_for(lambda: _live == 0, timeout=EXIT_WAIT_S)


def _carrying_hook(carrier, bucket):  # type: ignore[no-untyped-def]
    # (no annotations: DDP compares them with its own objects, and this module's are text)
    dist = torch.distributed
    group = carrier.group if carrier.group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    buffer = bucket.buffer()
    buffer.div_(world)  # DDP's default: the mean of the ranks' gradients
    index = bucket.index()
    if index == 0:  # DDP launches buckets in index order: 0 starts a reduction
        carrier.carrying_now = _loss_flags is not None or carrier.for_scaler
        carrier.carried_now = False
        carrier._sizes = {}
    carrier._sizes[index] = buffer.numel()
    carried = carrier.carrying_now and index == carrier.carry_at
    carrier.carried_now |= carried
    if carrier.reduced is None:
        carrier._bucketed.update(id(p) for p in bucket.parameters())
    if bucket.is_last():  # every bucket launched: this rank's gradients are all reduced
        # counted only if its flags rode along (a rebuilt layout may have no carry_at)
        carrier.reductions += carrier.carried_now
        carrier.carrying_now = False
        sizes = carrier._sizes
        carrier.carry_at = min(sizes, key=lambda i: (sizes[i], i))
        if carrier.reduced is None:
            carrier.reduced = frozenset(carrier._bucketed)
    if not carried:
        return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(
            _Then(lambda fut: fut.value()[0]))
    if _loss_flags is not None:
        bad, nonfinite, kept = _loss_flags(buffer.device)
    else:  # only a SafeGradScaler uses it: no loss flags, its last decision
        bad = nonfinite = torch.zeros((), dtype=torch.bool, device=buffer.device)
        kept = True
    last = carrier.last_skip
    last = (torch.zeros((), device=buffer.device) if last is None else last.to(buffer.device))
    flags = torch.stack([bad.to(buffer.dtype), nonfinite.to(buffer.dtype),
                         torch.full((), float(kept), dtype=buffer.dtype, device=buffer.device),
                         last.to(buffer.dtype)])
    joined = torch.cat([buffer, flags])
    carrier.world = world

    def split(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        out = fut.value()[0]
        buffer.copy_(out[:-CARRIED])
        carrier.received = out[-CARRIED:].clone()
        carrier.fresh = True
        return buffer
    return dist.all_reduce(joined, group=group, async_op=True).get_future().then(_Then(split))


_drain_registered = False


# optimizer -> the carrier of the DDP module holding its parameters, or None (fall back)
_carriers: weakref.WeakKeyDictionary[torch.optim.Optimizer, Carrier | None] = (
    weakref.WeakKeyDictionary())


def _ddp_of(optimizer: torch.optim.Optimizer) -> list[Any]:
    """The DistributedDataParallel modules holding any of the optimizer's parameters."""
    ddp_type = torch.nn.parallel.DistributedDataParallel
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return [m for m in _run.live_modules() if isinstance(m, ddp_type)
            and any(id(p) in params for p in m.module.parameters())]


def known_carrier(optimizer: torch.optim.Optimizer) -> Carrier | None:
    """The carrier :func:`carrier_of` found for ``optimizer``, if it was asked already."""
    return _carriers.get(optimizer)


def carrier_of(optimizer: torch.optim.Optimizer) -> Carrier | None:
    """The carrier of ``optimizer``'s DDP module: registered at the first step a patch asks
    (found once per optimizer); None where the patches keep their own all-reduce."""
    global _drain_registered
    if optimizer in _carriers:
        return _carriers[optimizer]
    carrier = None
    found = _ddp_of(optimizer)
    if len(found) == 1:
        ddp = found[0]
        carrier = getattr(ddp, "_training_patches_carrier", None)
        if carrier is None:
            carrier = Carrier(ddp)
            try:  # (kept for the module's life: DDP has no way to unregister a hook)
                if getattr(ddp, "_comm_hooks", None):
                    raise RuntimeError("a communication hook is registered already")
                ddp.register_comm_hook(carrier, _carrying_hook)
                if not _drain_registered:  # registered late: it runs before the user's and torch's
                    _drain_registered = True
                    atexit.register(_drain_at_exit)
                ddp._training_patches_carrier = carrier
            except (RuntimeError, ValueError) as exc:  # the user's hook (DDP allows one)
                carrier = None
                logger.warning(
                    "training-patches: the DistributedDataParallel model has a communication "
                    "hook of its own (%s), and DDP allows only one: the skip decision (the "
                    "NaN guard's, SafeGradScaler's overflow flag) cannot ride the gradient "
                    "reduction, so EVERY STEP MAKES ONE EXTRA ALL-REDUCE (a few floats) to "
                    "agree it across the ranks. Exact either way; to save the collective, "
                    "leave DDP's default reduction in place.",
                    str(exc).strip().splitlines()[0] if str(exc).strip() else "registered")
    elif found:
        logger.debug("training-patches: %d DDP modules hold the optimizer's parameters; the "
                     "skip decision is agreed by its own all-reduce", len(found))
    _carriers[optimizer] = carrier
    return carrier


def use_for_scaler(optimizer: torch.optim.Optimizer) -> Carrier | None:
    """The carrier of ``optimizer`` for a SafeGradScaler: it carries the flags from the
    next reduction on (for the module's life); None where it cannot (fall back)."""
    carrier = carrier_of(optimizer)
    if carrier is not None:
        carrier.for_scaler = True
    return carrier
