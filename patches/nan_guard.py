"""``nan_guard``: skip every optimizer step whose loss or gradients are NaN/Inf, exactly.

The step pipeline's ``decide`` and ``record`` stages (:mod:`patches._step`) judge each step
(one reduction, agreed across ranks: under DDP carried in DDP's own reduction); a bad step
leaves parameters, moments and step counts as they were, is recorded in
``nonfinite_events.jsonl`` (:data:`EVENTS_FILE`) and, after ``max_bad_steps`` in a row,
stops the run with :class:`NonFiniteTrainingError`. Outside the pipeline, because the user's
code calls them outside the optimizer step: ``Tensor.backward`` (a non-finite micro-batch
left out) and ``LRScheduler.step`` (held on a skipped step when ``lr_step_on_skip`` is 0).
Public: :func:`observe_loss`, :func:`expect_accumulation`, :func:`watch`, :func:`set_replay`,
:func:`find_nonfinite_source`, :func:`replaying`, :func:`settle`, :func:`stats`,
:func:`load_stats`, :func:`reset`, ``SPEC``.

Design: docs/design/nan_guard.md
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import math
import os
import warnings
from typing import Any, Callable, Iterator

import torch
from torch.nn.utils import get_total_norm

from . import _ddp, _dist, _options, _run, _step
from ._log import info, logger
from ._options import INT64_MAX, Option, flag, nonnegative_float, positive_int
from ._registry import PatchSpec, Site, register

EVENTS_FILE = _run.EVENTS_FILE


class NonFiniteTrainingError(FloatingPointError):
    """Too many consecutive optimizer steps had non-finite loss or gradients."""


class _State:
    """Everything the guard remembers between steps (one per process)."""

    def __init__(self) -> None:
        # Host counts: a good step only adds to "steps"; the rest is counted on bad steps,
        # whose flags the host reads anyway (fused steps: when their flags are settled).
        self.counts = dict.fromkeys(
            ("steps", "skipped", "nonfinite_losses", "nonfinite_grads", "spikes",
             "skipped_micro_batches", "peer_skips"), 0)
        self.host_steps = 0  # optimizer steps seen (known on the host, no sync)
        self.streak = 0  # consecutive skipped steps the host knows of
        self.first_bad: dict[str, Any] | None = None
        self.last_good_loss: torch.Tensor | None = None
        self.pending_loss: torch.Tensor | None = None
        # Fused steps whose flags the host has not read: (step, flag, grad flag, loss,
        # spike flag, what the host knew of that step: trainer step, sample ids and, with
        # several ranks, whether any rank's loss was non-finite).
        self.deferred: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None,
                                  torch.Tensor | None, dict[str, Any]]] = []
        self.names: dict[int, str] = {}  # id(parameter) -> name, from watch()
        self.replay: Callable[[], dict[str, Any]] | None = None
        self.replayed = False
        self.window: torch.Tensor | None = None
        self.window_count = 0
        self.set_found_inf: set[int] = set()
        # Gradient accumulation: scalar backward calls since the last optimizer step. When
        # steps take more than one, each loss is checked before its backward (one host read),
        # so a non-finite micro-batch is left out instead of dropping the whole step.
        self.backwards = 0
        self.left_out = 0  # of those, non-finite micro-batches left out
        self.kept_none = False  # the last step left out every micro-batch it had
        self.accumulating = False  # the last step took more than one backward
        self.accumulation_hint = False  # an integration said steps accumulate
        self.loss_from_backward = False  # pending_loss came from Tensor.backward
        self.events_path: str | None = None
        self.replaying = False  # find_nonfinite_source is re-running a batch
        # DDP, flags carried by the reduction: whether the ranks' last decisions differed
        self.diverged: torch.Tensor | None = None
        self.leaving_out = False  # the backward of a micro-batch left out is running


def _guard() -> _State:
    """The guard's books in the current run."""
    return _run.current().part(_State)


# -- what integrations and plain loops tell the guard ------------------------

def observe_loss(loss: torch.Tensor) -> None:
    """Hand the guard this step's loss (no sync): a non-finite loss skips the step, and
    the loss-spike test needs it. Integrations call it; plain loops need not (the loss
    is seen when it is backpropagated), but may."""
    state = _guard()
    state.pending_loss = loss.detach().float().reshape(-1)[:1].squeeze(0)
    state.loss_from_backward = False


def expect_accumulation(steps: int) -> None:
    """Tell the guard that optimizer steps accumulate ``steps`` micro-batches (an
    integration knows it from its config; plain loops are learned from their first step)."""
    _guard().accumulation_hint = steps > 1


def watch(model: torch.nn.Module, prefix: str = "") -> None:
    """Learn parameter names, so events say which gradients were non-finite."""
    named = model.named_parameters(prefix=prefix)
    _guard().names.update((id(param), name) for name, param in named)


def set_replay(replay: Callable[[], dict[str, Any]] | None) -> None:
    """Register how to re-run the current batch (see :func:`find_nonfinite_source`)."""
    _guard().replay = replay


def replaying() -> bool:
    """True while :func:`find_nonfinite_source` re-runs a batch on this rank alone (an
    integration must then start no collective the other ranks would not join)."""
    return _guard().replaying


# -- the decision ----------------------------------------------------------------

def _grads(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p.grad for group in optimizer.param_groups for p in group["params"]
            if p.grad is not None]


def _protected(optimizer: torch.optim.Optimizer, kwargs: dict[str, Any]) -> bool:
    """A GradScaler already decided this step (its own sync, or the fused protocol)."""
    return (_step.context().scaler_stepping or "grad_scaler" in kwargs
            or (hasattr(optimizer, "found_inf") and id(optimizer) not in _guard().set_found_inf))


def _spike_flag(loss: torch.Tensor, opts: _options.Options) -> torch.Tensor | None:
    state = _guard()
    if opts.spike_k <= 0:
        return None
    if state.window is None or state.window.numel() != opts.spike_window:
        state.window = torch.zeros(opts.spike_window, device=loss.device)
        state.window_count = 0
    if state.window_count < opts.spike_window:
        return torch.zeros((), dtype=torch.bool, device=loss.device)
    mean, std = state.window.mean(), state.window.std()
    return loss > mean + opts.spike_k * std


def _remember_loss(loss: torch.Tensor, bad: torch.Tensor, opts: _options.Options) -> None:
    """Put a good step's loss into the spike window (masked with where: no sync)."""
    state = _guard()
    if opts.spike_k <= 0 or state.window is None:
        return
    slot = state.window_count % opts.spike_window
    state.window[slot] = torch.where(bad, state.window[slot], loss.to(state.window.device))
    state.window_count += 1


def _agree(bad: torch.Tensor, bad_loss: torch.Tensor | None,
           optimizer: torch.optim.Optimizer | None = None, sharded: bool = False
           ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Every rank's decision: (any rank's flag, any rank's non-finite loss flag, whether
    any rank kept a micro-batch of this step); ``(bad, None, None)`` without a process group.

    Under DDP from the flags the gradient reduction carried (no collective; below), else one
    all-reduce (MAX) of a plain tensor (a DTensor has no sharding strategy for it). The
    second value tells a rank whose gradients are non-finite only through a peer's NaN loss
    that the peer saw it; the third, whether any rank's step has a gradient at all.
    """
    state = _guard()
    if not _dist.collectives():
        return bad, None, None
    if optimizer is not None and not sharded:
        carried = _agree_carried(optimizer, bad)
        if carried is not None:
            return carried
    dist = torch.distributed
    shared = torch.stack([bad, bad_loss if bad_loss is not None else torch.zeros_like(bad),
                          torch.full_like(bad, not state.kept_none)]).to(torch.float32)
    dist.all_reduce(shared, op=dist.ReduceOp.MAX)
    agreed = shared > 0
    carrier = _ddp.known_carrier(optimizer) if optimizer is not None else None
    if carrier is not None:  # agreed: the next reduction carries it as this rank's last
        carrier.last_skip = agreed[0].to(torch.float32)
    return agreed[0], agreed[1], agreed[2]


# -- DDP: the decision rides the gradient reduction -----------------------------------
#
# Under DDP the guard makes no collective of its own: the communication hook of
# patches/_ddp.py (shared with SafeGradScaler) appends this rank's loss flags and last
# decision to a bucket, and their sums over the ranks are the agreement (a non-finite
# gradient is in every rank's reduced gradient anyway). Where that is not enough (the user's
# own hook, no DDP module, a reduction that carried nothing; FSDP2) every rank falls back to
# the all-reduce alike. Ranks that a rank-local edit after the reduction made decide
# differently raise at the next step. Design: docs/design/nan_guard.md and step.md.

def _loss_flags(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """This rank's flags for the reduction under way (no host read)."""
    state = _guard()
    loss = None if state.leaving_out else state.pending_loss
    if loss is None:
        bad = nonfinite = torch.zeros((), dtype=torch.bool, device=device)
    else:
        value = loss.to(device)
        nonfinite = ~torch.isfinite(value)
        spike = _spike_flag(value, _options.current())
        bad = nonfinite if spike is None else nonfinite | spike
    return bad, nonfinite, not (0 < state.backwards <= state.left_out)  # kept a micro-batch


def _agree_carried(optimizer: torch.optim.Optimizer, bad: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The agreement from the sums the step's last reduction carried, with no collective:
    any rank's loss flag or this rank's gradient flag (the same on every rank: the gradients
    are reduced). None where no reduction carried them since the last decision (agree by
    all-reduce): only what every rank knows alike decides which, never a loss value."""
    carrier = _ddp.carrier_of(optimizer)
    if carrier is None or not carrier.fresh or carrier.received is None:
        return None
    carrier.fresh = False
    agreed = carrier.received.to(bad.device) > 0
    # every rank's last decision was carried: anything but none or all of them skipped is
    # ranks that diverged (a rank-local change of its gradients after the reduction)
    _guard().diverged = carrier.diverged()
    decided = bad | agreed[0]
    carrier.last_skip = decided.to(torch.float32)
    return decided, agreed[1], agreed[2]


def _step_boundary() -> None:
    """An optimizer step (taken, or skipped by a scaler): did it take several backwards?"""
    state = _guard()
    state.accumulating = state.backwards > 1
    state.kept_none = 0 < state.backwards <= state.left_out
    state.backwards = state.left_out = 0


class _ClosureRun:
    """A ``step(closure)``'s closure the guard already ran, to judge the gradients it made
    (Lightning's automatic optimization): the optimizer's first call gets that result back,
    later calls run the closure again (LBFGS evaluates it several times per step)."""

    def __init__(self, closure: Any, result: Any) -> None:
        self.closure, self.result, self.first = closure, result, True

    def __call__(self) -> Any:
        if self.first:
            self.first = False
            return self.result
        return self.closure()


def _decide_stage(optimizer: torch.optim.Optimizer, args: tuple[Any, ...],
                  kwargs: dict[str, Any],
                  step: _step.Step) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Decide the step on the gradients it will apply: a closure runs first (forward, backward,
    clip) and the optimizer gets one returning that result (a decision before the closure
    would judge the previous step's gradients and let this step's NaN through)."""
    # torch passes the step's own arguments with the optimizer first: (self, closure, ...)
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if not callable(closure) or isinstance(closure, _ClosureRun) or _protected(optimizer, kwargs):
        _decide(optimizer, kwargs, step)
        return None
    with torch.enable_grad():
        ran = _ClosureRun(closure, closure())
    _decide(optimizer, kwargs, step)
    if "closure" in kwargs:
        return args, {**kwargs, "closure": ran}
    return (args[0], ran, *args[2:]), kwargs


def _decide(optimizer: torch.optim.Optimizer, kwargs: dict[str, Any], step: _step.Step) -> None:
    state = _guard()
    context = _step.context()
    if not context.scaler_stepping:  # a scaler's step: its update() marks the boundary
        _step_boundary()
    if _protected(optimizer, kwargs):
        state.pending_loss = None
        return
    opts = _options.current()
    grads = _grads(optimizer)
    loss = state.pending_loss
    state.pending_loss = None
    state.diverged = None
    if not grads and loss is None:
        return
    sharded = bool(grads) and _dist.is_dtensor(grads[0])
    if sharded:
        # FSDP2: check this rank's own shards (no collective; the clip's replicated norm
        # would not say which rank's shards are bad), the ranks agree below.
        grads = [_dist.local(g) for g in grads]
        context.forget_clip()  # the clip's flag belongs to this step, judged by shards here
    device = grads[0].device if grads else loss.device  # type: ignore[union-attr]
    # The clip's flag for these very gradients, if it covered them: no second reduction.
    bad_grad = context.take_clip(grads) if grads and not sharded else None
    if bad_grad is None:
        bad_grad = (~torch.isfinite(get_total_norm(grads, 2.0, False, None)) if grads
                    else torch.zeros((), dtype=torch.bool, device=device))
    bad_grad = _dist.local(bad_grad).to(device)  # a flag of DTensors: this rank's value
    bad = bad_grad
    bad_loss = spike = None
    if loss is not None:
        loss = loss.to(device)
        bad_loss = ~torch.isfinite(loss)
        spike = _spike_flag(loss, opts)
        bad = bad | bad_loss if spike is None else bad | bad_loss | spike
    bad, any_bad_loss, any_kept = _agree(bad, bad_loss, optimizer, sharded)
    if state.kept_none and any_kept is not None and not bool(any_kept):
        # Every micro-batch of this step was non-finite on every rank: the zero gradients
        # they left (see _zero_leaf_gradients) go, as one process leaves None, so the
        # optimizer leaves every parameter as it was (one read, on such a rank only).
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
    state.host_steps += 1
    state.counts["steps"] += 1
    if loss is not None:
        _remember_loss(loss, bad, opts)
    context.mark("decide")

    if optimizer.defaults.get("fused") and not hasattr(optimizer, "found_inf"):
        # The fused kernel skips on found_inf by itself: no sync at all.
        optimizer.found_inf = bad.to(torch.float32)  # type: ignore[attr-defined]
        state.set_found_inf.add(id(optimizer))
        step.decision = step.for_scheduler = bad
        state.deferred.append((state.host_steps, bad, bad_grad, loss, spike,
                                {"trainer_step": _run.current().trainer_step,
                                 "samples": list(_run.current().batch_ids),
                                 "any_bad_loss": any_bad_loss}))
        if state.host_steps % opts.log_interval == 0:
            _log_stats()  # settles the flags
        elif len(state.deferred) >= min(opts.log_interval, opts.max_bad_steps):
            settle()  # often enough for the consecutive-skips stop
        return  # the kernel applies it or skips it on the device

    if state.diverged is not None:  # DDP, the flags carried: read with the decision
        skipped, diverged = (bool(v) for v in torch.stack([bad, state.diverged]).tolist())
        if diverged:
            _raise_diverged()
    else:
        skipped = bool(bad.item())  # the one host sync of a guarded step
    step.decision = step.for_scheduler = skipped
    if not skipped:
        state.streak = 0
        if loss is not None:
            state.last_good_loss = loss
    else:
        # Recorded first: the event names the non-finite gradients, gone after the skip.
        _on_bad_step(optimizer, state.host_steps, bad_grad, loss, spike,
                     any_bad_loss=any_bad_loss)
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None  # the optimizer now skips every parameter: an exact no-op
    if state.host_steps % opts.log_interval == 0:
        _log_stats()


def _record_stage(optimizer: torch.optim.Optimizer, kwargs: dict[str, Any],
                  step: _step.Step) -> None:
    state = _guard()
    if _step.context().phases is not None and not _protected(optimizer, kwargs):
        _step.context().mark("record")  # the guard's step ends (a scaler's ends at update())
    if not _step.context().scaler_stepping:
        # Backwards inside the step (LBFGS evaluating its closure again) belong to it, not
        # to the next step: they are no accumulation. A scaler's update() ends its steps.
        state.backwards = state.left_out = 0
    if id(optimizer) in state.set_found_inf:
        state.set_found_inf.discard(id(optimizer))
        del optimizer.found_inf  # type: ignore[attr-defined]


def settle() -> None:
    """Read the fused steps' waiting skip flags now (one copy) and record their skips: a
    trainer calls it where its records must be complete (a save, the end of training), not
    only at exit. May raise :class:`NonFiniteTrainingError`, as the step that read them would."""
    state = _guard()
    entries, state.deferred = state.deferred, []
    if not entries:
        return
    flags = torch.stack([entry[1] for entry in entries]).tolist()
    for (step, _, bad_grad, loss, spike, known), skipped in zip(entries, flags):
        if skipped:
            _on_bad_step(None, step, bad_grad, loss, spike, known,
                         any_bad_loss=known.get("any_bad_loss"))
        else:
            state.streak = 0
            if loss is not None:
                state.last_good_loss = loss  # known only now: no device work per step


# -- a bad step: record, explain, escalate -------------------------------------

def _value(tensor: torch.Tensor | None) -> float | None:
    return None if tensor is None else float(tensor.item())


def _learn_names(params: list[torch.Tensor]) -> None:
    """Name parameters by their full module path (a plain loop never names its model): the
    outermost live module holding the most of them names them (:func:`patches._run.live_modules`;
    ``block.1.weight``, never ``1.weight``), below the wrappers DDP and ``torch.compile`` add."""
    state = _guard()
    wanted = {id(p) for p in params if id(p) not in state.names}
    if not wanted:
        return
    best = 0
    tied: list[torch.nn.Module] = []
    for module in _run.live_modules():
        held = sum(1 for p in module.parameters() if id(p) in wanted)
        if held > best:
            best, tied = held, [module]
        elif held and held == best:
            tied.append(module)
    roots = _run.outermost(tied)
    if roots:
        watch(_unwrapped(roots[0]))


_WRAPPED = ("module", "_orig_mod")  # DistributedDataParallel, FSDP1; torch.compile


def _unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP/FSDP1/``torch.compile`` wrappers (names without their prefix)."""
    children = dict(module.named_children())
    while len(children) == 1 and next(iter(children)) in _WRAPPED and not any(
            True for _ in module.parameters(recurse=False)):
        module = next(iter(children.values()))
        children = dict(module.named_children())
    return module


def _bad_grad_names(optimizer: torch.optim.Optimizer | None) -> list[str]:
    if optimizer is None:
        return []
    # A bad step only: one read per parameter is acceptable here. DTensor gradients are
    # judged by this rank's shard (a DTensor refuses bool()).
    bad = [(g, i, p) for g, group in enumerate(optimizer.param_groups)
           for i, p in enumerate(group["params"])
           if p.grad is not None and not bool(torch.isfinite(_dist.local(p.grad)).all())]
    _learn_names([p for _, _, p in bad])
    names = _guard().names
    return [names.get(id(p), f"param_groups[{g}][{i}] {tuple(p.shape)}") for g, i, p in bad]


def _on_bad_step(optimizer: torch.optim.Optimizer | None, step: int, bad_grad: torch.Tensor,
                 loss: torch.Tensor | None, spike: torch.Tensor | None,
                 known: dict[str, Any] | None = None, *,
                 any_bad_loss: torch.Tensor | None = None) -> None:
    """Record a skipped step. ``known``: what the host knew at that step, when its flag is
    read later (fused optimizers); the batch is gone by then, so it is not replayed.
    ``any_bad_loss``: with several ranks, whether any rank's loss was non-finite."""
    state = _guard()
    state.streak += 1
    trainer_step = known["trainer_step"] if known is not None else _run.current().trainer_step
    loss_value = _value(loss)
    is_spike = bool(spike.item()) if spike is not None else False
    nonfinite_loss = loss_value is not None and not math.isfinite(loss_value)
    grad_seen = bool(bad_grad.item())
    if grad_seen and not nonfinite_loss and any_bad_loss is not None and bool(any_bad_loss):
        grad_seen = False  # a peer's NaN loss, spread here by the gradient sync
    # Skipped only because another rank saw a bad value (the decision is agreed).
    peer = not (nonfinite_loss or grad_seen or is_spike)
    counts = state.counts
    counts["skipped"] += 1
    counts["peer_skips"] += peer
    counts["nonfinite_losses"] += nonfinite_loss
    counts["nonfinite_grads"] += grad_seen
    counts["spikes"] += is_spike and not nonfinite_loss
    kind = "peer_nonfinite" if peer else "loss_spike" if is_spike and not nonfinite_loss else (
        "nonfinite_loss" if nonfinite_loss else "nonfinite_grad")
    event: dict[str, Any] = {
        "step": step,
        # the trainer's counter where an integration knows it; never the optimizer's own
        # step count, which a skipped step does not advance (the report counts "step")
        "trainer_step": trainer_step,
        "kind": kind,
        "loss": loss_value,
    }
    if not peer:  # a follower has no gradient list of its own (and no bogus one)
        scaler = _step.context().pending_scaler()
        event["nonfinite_grads"] = _bad_grad_names(optimizer) if grad_seen else []
        event["scale"] = scaler.get_scale() if scaler is not None else None
    event["samples"] = list(known["samples"] if known is not None else _run.current().batch_ids)
    event["consecutive"] = state.streak
    if known is not None:
        event["read_at_step"] = state.host_steps  # the flag waited on the device till then
    if state.first_bad is None or state.streak == 1:
        state.first_bad = event
    path = _record(event, replay=not is_spike and not peer and known is None)
    where = (f"trainer step {trainer_step} (optimizer step {step})"
             if trainer_step is not None else f"optimizer step {step}")
    if peer:
        logger.warning("nan_guard: %s skipped on rank %d of %d because another rank saw a "
                       "non-finite loss or gradient or a loss spike (this rank's own loss: %s; "
                       "its gradients were finite apart from what the gradient sync brought "
                       "from that rank); every rank skips the same steps; %s", where,
                       _dist.rank(), _dist.world_size(), loss_value, _run.where_recorded(path))
    else:
        grads = event["nonfinite_grads"]
        what = f"non-finite gradients in {_listed(grads)}" if grads else kind
        logger.warning("nan_guard: %s skipped: the whole optimizer step (%s; loss=%s)%s; %s",
                       where, what, loss_value, _details(event), _run.where_recorded(path))
    if state.streak >= _options.current().max_bad_steps:
        _raise(step)


def _record(event: dict[str, Any], replay: bool = False) -> str:
    """Append ``event`` to the events file, first replaying the run's first bad batch
    where ``replay`` allows it; returns where it was recorded."""
    state = _guard()
    if replay and _options.current().replay and not state.replayed and state.replay is not None:
        state.replayed = True
        event["source"] = state.replay()
    state.events_path = _run.append_jsonl(EVENTS_FILE, event)
    return state.events_path


def _details(event: dict[str, Any]) -> str:
    """The samples and the replay's source of an event, as its warning ends."""
    return ((f"; samples: {', '.join(event['samples'][:4])}" if event["samples"] else "")
            + (f"; source: {event['source']}" if event.get("source") else ""))


def _listed(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")


def _raise_diverged() -> None:
    state = _guard()
    raise NonFiniteTrainingError(
        f"nan_guard: the ranks did not all take the same decision at the last optimizer step "
        f"(optimizer step {state.host_steps - 1}): some skipped it and some took it, so the "
        f"DDP replicas now differ. Under DDP every rank's gradients are equal once reduced, and "
        f"the guard carries the loss flags in that reduction; ranks can only decide "
        f"differently when code on one rank changes its gradients AFTER the reduction (an "
        f"edit of p.grad between backward() and step() on one rank). Change gradients before "
        f"the reduction (a tensor hook, or the loss), or the same way on every rank. Seen on "
        f"rank {_dist.rank()} of {_dist.world_size()}; every rank stops here.")


def _raise(step: int) -> None:
    state = _guard()
    first = state.first_bad or {}
    samples = first.get("samples") or []
    raise NonFiniteTrainingError(
        f"nan_guard: {state.streak} consecutive optimizer steps had non-finite loss or "
        f"gradients (the limit is {_options.current().max_bad_steps}), so the run stops at step "
        f"{step} instead of burning GPU hours"
        + (f" (a fused optimizer's skip flags are read every few steps: this was seen at "
           f"optimizer step {state.host_steps}; every step in between was skipped or "
           f"trained exactly)" if state.host_steps != step else "")
        + f". The first bad step of this streak was step "
        f"{first.get('step')} (trainer step {first.get('trainer_step')}): "
        f"{first.get('kind')}, loss={first.get('loss')}, non-finite gradients: "
        f"{', '.join(first.get('nonfinite_grads') or []) or 'none found'}, loss scale: "
        f"{first.get('scale')}; samples in that batch: {', '.join(samples) or 'unknown'}. "
        f"The last finite loss was {_value(state.last_good_loss)}."
        + (f" Where it started: {first['source']}." if first.get("source") else "")
        + f" Every skipped step is in {state.events_path}. Try: a lower learning rate; "
        "checking those samples (`training-patches report RUN_DIR` lists them); fp32 "
        "instead of fp16/bf16 (on a T4, disable fp16); TRAINING_PATCHES_ANOMALY=1 for one run "
        "to name the operation. TRAINING_PATCHES_MAX_BAD_STEPS raises the limit.")


def _log_stats() -> None:
    state = _guard()
    counts = stats()
    info("nan_guard stats @ step %d: skipped %d of %d optimizer steps (non-finite losses %d, "
         "non-finite gradients %d, loss spikes %d%s)", state.host_steps, counts["skipped"],
         counts["steps"], counts["nonfinite_losses"], counts["nonfinite_grads"], counts["spikes"],
         f", skipped for another rank {counts['peer_skips']}" if _dist.world_size() > 1 else "")


def record_trainer_skip(trainer: str, step: int | None, why: str) -> str:
    """Record a step that a trainer skipped by itself (DeepSpeed's fp16 loss scaler on an
    overflow): the guard never saw it, so without this it would be in no record. Returns
    where it was recorded."""
    _guard().counts["skipped"] += 1
    event = {"step": step, "trainer_step": _run.current().trainer_step, "kind": "trainer_skip",
             "trainer": trainer, "action": why, "samples": list(_run.current().batch_ids)}
    path = _record(event)
    logger.warning("nan_guard: %s skipped optimizer step %s by itself (%s); %s", trainer, step,
                   why, _run.where_recorded(path))
    return path


def _settle_at_exit() -> None:
    """Fused steps whose flags were never read (the last few of a run, below the settle
    interval): read and recorded at exit, so no skip goes unrecorded. Never raises."""
    state = _guard()
    try:
        settle()
    except Exception as exc:  # noqa: BLE001 - at exit: say it, never fail the process
        logger.warning("training-patches nan_guard: could not read the last fused steps' "
                       "flags at exit (%s); up to %d skip(s) may be unrecorded",
                       exc, len(state.deferred))


# Registered after patches._run's own handler (imported above), so it runs before it: the
# records it writes are retried by _run at exit if their file cannot be written.
atexit.register(_settle_at_exit)


def stats() -> dict[str, int]:
    """Counters as plain ints (settles deferred fused-step flags first): ``steps`` and
    ``skipped`` are the decisions, alike on every rank; the others count what this rank saw
    (``peer_skips``: skipped only for another rank; docs/design/nan_guard.md)."""
    state = _guard()
    settle()
    return {**state.counts, "consecutive_skips": state.streak}


def load_stats(counts: dict[str, int]) -> None:
    """Restore counters saved from :func:`stats` (e.g. on resume)."""
    state = _guard()
    for name in state.counts:
        state.counts[name] = int(counts.get(name, 0))
    state.streak = int(counts.get("consecutive_skips", 0))
    state.host_steps = state.counts["steps"]


def reset(keep_replay: bool = True) -> None:
    """Forget counters, events and names (a new run in the same process)."""
    replay = _guard().replay
    state = _run.current().renew(_State)
    _step.forget_decisions()
    if keep_replay:
        state.replay = replay


# -- micro-batches: a non-finite loss adds nothing to the accumulated gradient -------

def _on_bad_micro_batch(loss: torch.Tensor) -> None:
    state = _guard()
    state.counts["nonfinite_losses"] += 1
    state.counts["skipped_micro_batches"] += 1
    value = float(loss.detach().float().reshape(-1)[0])
    if state.pending_loss is not None and not bool(torch.isfinite(state.pending_loss)):
        state.pending_loss = None  # this loss was the one observed: it is dealt with here
    event = {
        "step": state.host_steps + 1,
        "trainer_step": _run.current().trainer_step,
        "kind": "nonfinite_loss",
        "micro_batch": True,
        "action": "left out of the accumulated gradient; the optimizer step uses the others",
        "loss": value,
        "samples": list(_run.current().batch_ids),
    }
    path = _record(event, replay=True)
    trainer_step = _run.current().trainer_step
    where = (f"trainer step {trainer_step}" if trainer_step is not None
             else f"a micro-batch of optimizer step {event['step']}")
    logger.warning("nan_guard: %s: non-finite loss (%s); this micro-batch is left out of the "
                   "accumulated gradient and the optimizer step uses the others%s; %s",
                   where, value, _details(event), _run.where_recorded(path))


@contextlib.contextmanager
def _zero_leaf_gradients(loss: torch.Tensor) -> Iterator[None]:
    """While a backward of ``loss`` runs, every gradient reaching a leaf (a parameter's
    ``AccumulateGrad``) is replaced by zeros; every other node runs as usual, so the
    gradient hooks of DDP and FSDP2 communicate exactly as for a good micro-batch.
    Walks the graph once: only for a non-finite micro-batch, never per step."""
    handles = []
    seen: set[Any] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):  # AccumulateGrad: the leaf's gradient lands here
            handles.append(node.register_prehook(
                lambda grads: tuple(None if g is None else torch.zeros_like(g)
                                    for g in grads)))
        stack.extend(next_node for next_node, _ in node.next_functions)
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _make_backward(original: Callable[..., Any]) -> Callable[..., Any]:
    def backward(self: torch.Tensor, gradient: Any = None, retain_graph: Any = None,
                 create_graph: bool = False, inputs: Any = None) -> Any:
        state = _guard()
        if gradient is not None or self.numel() != 1 or not self.requires_grad or \
                state.replaying:
            return original(self, gradient, retain_graph, create_graph, inputs)
        state.backwards += 1
        if state.pending_loss is None or state.loss_from_backward:
            # no observe_loss() call: the loss being backpropagated is the one to record
            observe_loss(self)
            state.loss_from_backward = True
        result = None
        if ((state.accumulating or state.accumulation_hint)
                and not bool(torch.isfinite(self.detach()).all())):
            state.left_out += 1
            if _dist.collectives():
                # Several ranks: the peers' backward of this micro-batch may communicate
                # (DDP, FSDP2), so it runs with zero leaf gradients: left out on every rank
                # without a hang (docs/design/nan_guard.md, "Gradient accumulation").
                state.leaving_out = True  # its loss is no flag of the step's (DDP's carrier)
                try:
                    with _zero_leaf_gradients(self):
                        result = original(self, gradient, retain_graph, create_graph, inputs)
                finally:
                    state.leaving_out = False
            # Recorded (and replayed) only after that backward: a replay's backward on this
            # rank alone while DDP expects this micro-batch's gradients would reduce alone.
            _on_bad_micro_batch(self)
        else:
            result = original(self, gradient, retain_graph, create_graph, inputs)
        _step.context().mark("backward")
        return result
    backward.__wrapped__ = original  # type: ignore[attr-defined]
    backward.__doc__ = original.__doc__
    return backward


def _make_save(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(f, (str, os.PathLike)):
            _run.saw_checkpoint(f)
        return original(obj, f, *args, **kwargs)
    return save


def _make_next(original: Callable[..., Any]) -> Callable[..., Any]:
    # A plain loop's batches name their samples for the guard's events, with no extra call.
    @functools.wraps(original)
    def __next__(self: Any) -> Any:
        batch = original(self)
        _run.current().batch_ids = _run.sample_ids(batch)
        return batch
    return __next__


# -- the LR scheduler --------------------------------------------------------------

def _make_scheduler_step(original: Callable[..., Any]) -> Callable[..., Any]:
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        optimizer = getattr(self, "optimizer", None)
        # a scheduler built on accelerate's AcceleratedOptimizer: the decision is its inner one's
        inner = getattr(optimizer, "optimizer", None)
        decision = _step.take_scheduler_decision(optimizer)
        if decision is None and inner is not None:
            decision = _step.take_scheduler_decision(inner)
        if _options.current().lr_step_on_skip:
            return original(self, *args, **kwargs)  # nothing to read (fused: no host read)
        if isinstance(decision, torch.Tensor):
            decision = bool(decision.item())
        if decision:
            logger.debug("nan_guard: LR scheduler held on a skipped step")
            return None
        return original(self, *args, **kwargs)
    step.__wrapped__ = original  # type: ignore[attr-defined]
    return step


# -- finding the source -----------------------------------------------------------

def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _nonfinite(value: Any) -> bool:
    return any(t.is_floating_point() and not bool(torch.isfinite(t).all())
               for t in _tensors(value))


def find_nonfinite_source(model: torch.nn.Module,
                          closure: Callable[[], torch.Tensor]) -> dict[str, Any]:
    """Re-run one batch (``closure`` returns its loss) with forward hooks and anomaly mode.

    Returns ``found`` (True when the re-run named a culprit), the first module whose
    input or output was non-finite and the backward operation anomaly mode named; when
    nothing was named, ``reason`` says why (the re-run stayed finite, or only gradients
    went infinite, which anomaly mode does not flag). RNG state is restored, gradients
    are cleared: the run continues as if the replay never happened. Costs one slow step:
    call it for the first bad batch, never every step.
    """
    state = _guard()
    found: dict[str, Any] = {}

    def hook(name: str) -> Callable[..., None]:
        def check(module: torch.nn.Module, inputs: Any, output: Any) -> None:
            if "module" in found:
                return
            where = "input" if _nonfinite(inputs) else "output" if _nonfinite(output) else None
            if where is not None:
                found.update(module=name or type(model).__name__, where=where,
                             type=type(module).__name__)
        return check

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules()]
    # Under gradient accumulation the other micro-batches' gradients are in .grad: the
    # replay must neither add to them nor clear them.
    params = list(model.parameters())
    kept = [p.grad for p in params]
    for p in params:
        p.grad = None
    state.replaying = True
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        with warnings.catch_warnings(record=True) as caught, \
                torch.autograd.detect_anomaly(check_nan=True):
            warnings.simplefilter("always")
            try:
                loss = closure()
                if not bool(torch.isfinite(loss).all()) and "module" not in found:
                    found.update(module="loss", where="output", type="loss")
                loss.backward()
            except RuntimeError as exc:
                found["operation"] = str(exc).splitlines()[0]
        for w in caught:
            text = str(w.message)
            if "Traceback of forward call" in text:
                lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
                found["forward_call"] = lines[-1]
                break
        if "module" not in found and "operation" not in found:
            found.update(found=False, reason=_nothing_found_reason(model))
        else:
            found = {"found": True, **found}
    finally:
        for handle in handles:
            handle.remove()
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        for p, grad in zip(params, kept):
            p.grad = grad
        state.replaying = False
    return found


def _nothing_found_reason(model: torch.nn.Module) -> str:
    """Why a replay named no module: read from the gradients the re-run left."""
    bad = [name for name, p in model.named_parameters()
           if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
    if bad:
        return (f"the re-run's loss and every module's inputs and outputs were finite, but "
                f"the gradients of {_listed(bad)} were not: infinite values from an overflow in "
                "backward, which anomaly mode (it checks for NaN only) does not trace to an "
                "operation")
    return ("the batch was re-run with forward hooks and anomaly mode and its loss, every "
            "module's inputs and outputs and its gradients were finite: the non-finite value "
            "did not recur (it came from state the re-run does not reproduce, e.g. the loss "
            "scale of a mixed-precision step, RNG drawn differently, or a nondeterministic "
            "kernel)")


# -- the patch -----------------------------------------------------------------------

def _enable(options: Any) -> None:
    _step.on_iteration_end(_step_boundary)
    _ddp.carry_loss_flags(_loss_flags)
    _step.set_stage("decide", _decide_stage)
    _step.set_stage("record", _record_stage)


def _disable() -> None:
    _ddp.carry_loss_flags(None)
    _step.set_stage("decide", None)
    _step.set_stage("record", None)


SPEC = register(PatchSpec(
    name="nan_guard",
    describe=lambda o: (
        f"optimizer steps with NaN/Inf loss or gradients are skipped exactly (stop after "
        f"{o.max_bad_steps} in a row" + (f"; loss spikes > {o.spike_k:g} sd skipped"
                                        if o.spike_k > 0 else "") + ")"),
    enable=_enable,
    disable=_disable,
    sites=(
        Site("torch.optim.lr_scheduler", "LRScheduler.step", _make_scheduler_step,
             lost="TRAINING_PATCHES_LR_STEP_ON_SKIP=0 cannot hold the LR scheduler"),
        Site("torch._tensor", "Tensor.backward", _make_backward,
             lost="with gradient accumulation a non-finite micro-batch drops the whole step"),
        Site("torch", "save", _make_save,
             lost="events of a plain loop go to ./training_patches/, not its checkpoint folder"),
        Site("torch.serialization", "save", _make_save),
        Site("torch.utils.data.dataloader", "_BaseDataLoaderIter.__next__", _make_next,
             lost="events of a plain loop name no samples"),
    ),
    stats=stats,
    load_stats=load_stats,
    options=(
        Option("max_bad_steps", positive_int, 25, "a whole number of steps of at least 1, e.g. 25",
               "consecutive steps the NaN guard skips before the run stops", low=1,
               high=INT64_MAX, bound_why="steps are counted in int64"),
        Option("spike_k", nonnegative_float, 0.0,
               "a number of standard deviations, e.g. 6 (0 = off)",
               "skip a step whose loss is this many standard deviations above the window",
               shown_default="0 (off)", low=0, high=1e6,
               bound_why="a loss a million standard deviations above the window is no test "
                         "any more, and k times the deviation must stay finite in float32"),
        Option("spike_window", positive_int, 100, "a whole number of steps of at least 2, e.g. 100",
               "losses in the spike guard's window", low=2, high=100_000,  # 400 KB of float32
               bound_why="the window is a tensor on the training device whose mean and "
                         "deviation are taken at every step"),
        Option("lr_step_on_skip", flag, True, "1 or 0",
               "1: the LR scheduler still steps on a skipped step, so it follows the trainer's "
               "step count; 0: it is held"),
        Option("replay", flag, True, "1 or 0",
               "replay the first bad batch once to find the module that made the NaN"),
    ),
))
