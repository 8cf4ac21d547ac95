"""A checkpoint's state as parts (model, optimizer, scheduler, scaler, step, RNG, runtime
counters, data position, EMA weights), each one unit (a :class:`Part`: ``plan``, ``apply``,
``report``) listed once in :data:`UNITS`. A single file and a sharded folder are two
:class:`Source` s of the same parts, served by one path: :func:`saved_state`,
:func:`plan_state`, :func:`carry_out`; only the model's work differs by source (a
:class:`ModelSource`). Design: docs/design/checkpoint.md.
"""

from __future__ import annotations

import logging
import operator
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from .. import _dist
from .._version import __version__
from . import data_position
from . import ema as ema_part
from .errors import CheckpointError, CheckpointMismatchError
from .optimizer import (_as_list, _check_plain_state, _detach_from_file, _restart_scaler,
                        _restart_scheduler, check_kinds, class_names, restore_optimizer,
                        scaler_enabled, snapshot_optimizer)
from .reading import _what_to_do
from .report import LoadReport, _runtime_state
from .rng import capture_rng_state, restore_rng_state

logger = logging.getLogger("training_patches")

# Where checkpoints keep their step: ours and coqui's "step"; plain loops often
# "global_step" (IndexTTS, transformers-style loops) or "iteration".
STEP_KEYS = ("step", "global_step", "iteration")
# Where they keep RNG states: ours "rng"; trainers' own files often "rng_state".
RNG_KEYS = ("rng", "rng_state")


def saved_state(step: int, optimizers: list[Any], schedulers: list[Any], scaler: Any,
                extra: dict[str, Any], data_ranks: list[Any] | None = None) -> dict[str, Any]:
    """What a checkpoint stores beside the model's tensors, the same keys in a file and in
    a folder's ``meta.pt`` (a folder keeps ``data_ranks`` in per-rank files instead)."""
    from .. import _api  # lazy: import order of the patches (see RuntimePart.apply)

    state: dict[str, Any] = {
        "step": step,
        "scheduler": [s.state_dict() for s in schedulers] or None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        # "classes" is compared at load: a state of another class is refused.
        "training_patches": {"version": __version__, "runtime": _api.runtime_state(),
                             "classes": {"optimizer": class_names(optimizers),
                                         "scheduler": class_names(schedulers)}},
        "extra": extra,
    }
    if isinstance(extra.get("epoch"), int):
        state["epoch"] = extra["epoch"]
    if data_ranks is not None:
        state["data_ranks"] = data_ranks
    return state


@dataclass(frozen=True)
class Source:
    """What one checkpoint holds, read before anything changes. ``kind`` is "file" or
    "folder" (the word of the messages); ``meta``: the file's dict (empty for a bare state
    dict) or the folder's ``meta.pt``; ``saved_optimizers``: a file's optimizer states (a
    folder's come with its shards); ``read_rng()``: this rank's saved RNG state or None."""

    path: Path
    kind: str
    meta: Mapping[str, Any]
    has_optimizer: bool
    read_rng: Callable[[], Mapping[str, Any] | None]
    rng_in_file: bool
    model: "ModelSource"  # how this source plans, loads and reports the model's tensors
    saved_optimizers: list[Any] = field(default_factory=list)
    # every rank's saved data position (None: the source holds none), read on demand
    read_data: Callable[[], list[Any] | None] = lambda: None
    data_in_file: bool = False
    # the EMA weights planned for the EMA given and the model's plan (matched, checked,
    # grown as the model's: :mod:`.ema`); called only when an EMA was passed and the
    # source holds EMA weights
    plan_ema: Callable[[Any, Any], Any] = lambda ema, model_plan: None
    ema_in_file: bool = False


@dataclass
class StatePlan:
    """What a load will do to every part, decided before any change. ``effective`` is the
    policy carried out (``remap`` falls back to ``reset`` when the source has no optimizer
    state); ``optimizer_states`` None: the source loads the moments itself (DCP)."""

    source: Source
    policy: str
    effective: str
    optimizers: list[Any]
    schedulers: list[Any]
    scaler: Any
    scaler_on: bool  # a scaler was passed and is enabled
    saved_scheds: list[Any]
    saved_scaler: Any
    optimizer_states: list[dict[str, Any]] | None
    moments_resized: list[str]
    saved_step: int | None
    epoch: int | None
    extra: dict[str, Any]
    rng: Mapping[str, Any] | None
    asked_rng: bool | None
    runtime: dict[str, dict[str, float]] | None
    loader: Any = None
    data: Mapping[str, Any] | None = None  # the position to arm the loader with
    data_part: tuple[str, str] | None = None  # (status, detail) of the report's data part
    ema: Any = None  # the EMA passed to the load (its module)
    ema_plan: Any = None  # the EMA weights to load (a plan.ModelPlan; None: nothing to load)
    ema_counters: Any = None  # (the EMA's counters to set, in words): ema.counters_plan
    resume_epoch: int = 0  # the epoch a training loop continues at (LoadReport.resume_epoch)
    model_plan: Any = None  # what the source's model part decided (a file's plan.ModelPlan)
    resume_step: bool = True  # False: a weights-only start, counted from step 0

    @property
    def fell_back(self) -> bool:
        """``remap`` was asked and the source has no optimizer state: all three start fresh."""
        return self.effective != self.policy


# (each optimizer's saved state with its moments grown onto the model's rows, the names of
# the parameters whose moments were resized), from the plan whose model part was decided
OptimizerRemap = Callable[[StatePlan], "tuple[list[dict[str, Any]], list[str]]"]


class Part:
    """One piece of a checkpoint's state: :meth:`plan` decides it (it may refuse, it changes
    nothing), :meth:`apply` carries it out (each change with its undo), :meth:`report` says
    what was done. A part with ``apply_last`` is applied after the others."""

    name = ""
    apply_last = False

    def plan(self, plan: StatePlan, remap: OptimizerRemap | None, resume_step: bool) -> None:
        """Decide this part (raises :class:`CheckpointError` to refuse the whole load)."""

    def apply(self, plan: StatePlan, report: LoadReport, undo: list[Callable[[], None]]) -> None:
        """Carry this part out, appending to ``undo`` what puts each change back."""

    def report(self, plan: StatePlan, report: LoadReport, resume_step: bool) -> None:
        """Set this part's entry of ``report.parts``."""


def _why(plan: StatePlan) -> str:
    """Why a part was started fresh: the policy asked for it, or the source has no
    optimizer state."""
    return ("policy reset" if not plan.fell_back
            else f"the {plan.source.kind} has no optimizer state")


def _fresh_or_dropped(report: LoadReport, plan: StatePlan, name: str, given: bool,
                      in_file: bool, restarted: bool) -> None:
    """The part ``name`` was not restored: started fresh, dropped or absent."""
    if restarted:
        detail = "absent in file" if not in_file else f"{_why(plan)}; the file's state not loaded"
        report.set_part(name, "reset", detail, in_file=in_file)
    elif in_file:
        report.set_part(name, "dropped", f"no {name} passed" if not given
                        else f"the {name} passed is disabled", in_file=True)
    else:
        report.set_part(name, "absent", "left as passed" if given else "")


class ModelSource:
    """How one source plans, loads and reports the model's tensors (a file's
    :class:`.file_model.FileModel`, a folder's :class:`.sharded.ShardedModel`)."""

    def plan(self, plan: StatePlan) -> Any:
        raise NotImplementedError

    def apply(self, plan: StatePlan, report: LoadReport, undo: list[Callable[[], None]]) -> None:
        raise NotImplementedError

    def report(self, plan: StatePlan, report: LoadReport) -> None:
        raise NotImplementedError


class ModelPart(Part):
    """The model's tensors, through the source's :class:`ModelSource`: planned first (the
    moments and the EMA grow as its rows do), applied last (it cannot always be put back)."""

    name = "model"
    apply_last = True

    def plan(self, plan: StatePlan, remap: OptimizerRemap | None, resume_step: bool) -> None:
        plan.model_plan = plan.source.model.plan(plan)

    def apply(self, plan: StatePlan, report: LoadReport, undo: list[Callable[[], None]]) -> None:
        plan.source.model.apply(plan, report, undo)

    def report(self, plan: StatePlan, report: LoadReport, resume_step: bool) -> None:
        plan.source.model.report(plan, report)


class OptimizerPart(Part):
    """The optimizer states: loaded with the moments of grown rows grown (``remap``), or
    every optimizer emptied, its LR back at ``initial_lr`` (``reset``)."""

    name = "optimizer"

    def plan(self, plan: StatePlan, remap: OptimizerRemap | None, resume_step: bool) -> None:
        source = plan.source
        if plan.policy == "remap":  # a state of another class is refused, never "restored"
            check_kinds(source.path, source.meta, plan.optimizers, source.saved_optimizers,
                        plan.schedulers, plan.saved_scheds)
        if remap is None:  # the source loads the moments itself (DCP, with the shards)
            return
        plan.optimizer_states = []
        if plan.effective == "remap" and plan.optimizers:
            plan.optimizer_states, plan.moments_resized = remap(plan)

    def apply(self, plan: StatePlan, report: LoadReport, undo: list[Callable[[], None]]) -> None:
        if plan.effective == "remap":
            for state, opt in zip(plan.optimizer_states or (), plan.optimizers):
                undo.append(lambda o=opt, s=snapshot_optimizer(opt): restore_optimizer(o, s))
                opt.load_state_dict(state)
                _detach_from_file(opt.state, plan.source.path)
            if plan.optimizers:
                report.restored.append("optimizer")
            return
        for opt in plan.optimizers:
            undo.append(lambda o=opt, s=snapshot_optimizer(opt): restore_optimizer(o, s))
            opt.state = defaultdict(dict)
            for group in opt.param_groups:
                if "initial_lr" in group:
                    group["lr"] = group["initial_lr"]

    def report(self, plan: StatePlan, report: LoadReport, resume_step: bool) -> None:
        optimizers = plan.optimizers
        if optimizers and plan.effective == "remap":
            own = f"{len(optimizers)} optimizers" if len(optimizers) > 1 else ""
            if report.optimizer_moments_resized:
                moments = (f"moments of {len(report.optimizer_moments_resized)} grown "
                           "parameter(s) resized: new rows' first moment 0, second moment the "
                           "old rows' mean")
                report.set_part("optimizer", "remapped", "; ".join(p for p in (own, moments) if p),
                                in_file=True)
            else:
                report.set_part("optimizer", "restored", own, in_file=True)
        else:
            _fresh_or_dropped(report, plan, "optimizer", bool(optimizers),
                              plan.source.has_optimizer, bool(optimizers))


class SchedulerPart(Part):
    """The LR schedulers: their saved states (``remap``), or restarted at step 0 with their
    warmup (``reset``)."""

    name = "scheduler"

    def plan(self, plan: StatePlan, remap: OptimizerRemap | None, resume_step: bool) -> None:
        path, schedulers, saved = plan.source.path, plan.schedulers, plan.saved_scheds
        if plan.effective == "remap" and schedulers and saved:
            if len(saved) < len(schedulers):
                raise CheckpointMismatchError(
                    f"training-patches: {path} holds {len(saved)} scheduler state(s), "
                    f"{len(schedulers)} schedulers were given. Nothing was loaded. Use "
                    f"policy='reset'.")
            for state, sched in zip(saved, schedulers):
                _check_plain_state(path, "scheduler", state, sched)

    def apply(self, plan: StatePlan, report: LoadReport, undo: list[Callable[[], None]]) -> None:
        if plan.effective != "remap":
            for sched in plan.schedulers:
                undo.append(lambda o=sched, s=dict(sched.__dict__): _restore_dict(o, s))
                _restart_scheduler(sched)
        elif plan.schedulers and plan.saved_scheds:
            for state, sched in zip(plan.saved_scheds, plan.schedulers):
                undo.append(lambda o=sched, s=dict(sched.__dict__): _restore_dict(o, s))
                sched.load_state_dict(dict(state))
            report.restored.append("scheduler")
        elif plan.schedulers:
            report.reset.append("scheduler (not in the checkpoint)")

    def report(self, plan: StatePlan, report: LoadReport, resume_step: bool) -> None:
        if plan.schedulers and plan.effective == "remap" and plan.saved_scheds:
            report.set_part("scheduler", "restored", in_file=True)
        else:
            _fresh_or_dropped(report, plan, "scheduler", bool(plan.schedulers),
                              bool(plan.saved_scheds),
                              bool(plan.schedulers) and plan.effective == "reset")


class ScalerPart(Part):
    """The GradScaler: its saved scale and counters (``remap``), or a fresh scale
    (``reset``). Only an enabled scaler takes a state (:func:`scaler_enabled`)."""

    name = "scaler"

    def plan(self, plan: StatePlan, remap: OptimizerRemap | None, resume_step: bool) -> None:
        if plan.effective == "remap" and plan.scaler_on and plan.saved_scaler:
            _check_plain_state(plan.source.path, "scaler", plan.saved_scaler, plan.scaler)

    def apply(self, plan: StatePlan, report: LoadReport, undo: list[Callable[[], None]]) -> None:
        scaler = plan.scaler
        if plan.effective != "remap":
            if scaler is not None:
                snap = scaler.state_dict() if scaler_enabled(scaler) else None
                if snap:
                    undo.append(lambda s=snap: scaler.load_state_dict(s))
                _restart_scaler(scaler)
        elif plan.scaler_on:
            if plan.saved_scaler:
                snap = scaler.state_dict()
                if snap:
                    undo.append(lambda s=snap: scaler.load_state_dict(s))
                scaler.load_state_dict(dict(plan.saved_scaler))
                report.restored.append("scaler")
            else:
                report.reset.append("scaler (not in the checkpoint)")

    def report(self, plan: StatePlan, report: LoadReport, resume_step: bool) -> None:
        if plan.scaler_on and plan.effective == "remap" and plan.saved_scaler:
            report.set_part("scaler", "restored", in_file=True)
        else:
            _fresh_or_dropped(report, plan, "scaler", plan.scaler is not None,
                              bool(plan.saved_scaler), plan.scaler_on and plan.effective == "reset")


class StepPart(Part):
    """The step count (with the epoch and ``extra``): the saved step, or 0 under ``reset``
    and for a weights-only start."""

    name = "step"

    def report(self, plan: StatePlan, report: LoadReport, resume_step: bool) -> None:
        saved = report.saved_step
        if saved is None:
            report.set_part("step", "absent", "resuming at 0")
        elif plan.effective == "reset":
            report.set_part("step", "reset", f"saved {saved}, resuming at 0: {_why(plan)}",
                            in_file=True)
        elif not resume_step:
            report.set_part("step", "dropped", f"saved {saved}; a weights-only start counts "
                            "from 0", in_file=True)
        else:
            report.set_part("step", "restored", in_file=True)


class RngPart(Part):
    """This rank's RNG states (CPU, CUDA, numpy, random), restored under ``remap`` unless
    ``restore_rng`` says otherwise."""

    name = "rng"

    def plan(self, plan: StatePlan, remap: OptimizerRemap | None, resume_step: bool) -> None:
        asked = plan.asked_rng
        restore = (plan.effective == "remap") if asked is None else asked
        plan.rng = plan.source.read_rng() if restore else None

    def apply(self, plan: StatePlan, report: LoadReport, undo: list[Callable[[], None]]) -> None:
        if plan.rng is not None:
            undo.append(lambda s=capture_rng_state(): restore_rng_state(s))
            restore_rng_state(plan.rng)
            report.rng_restored = True

    def report(self, plan: StatePlan, report: LoadReport, resume_step: bool) -> None:
        asked = plan.asked_rng
        if report.rng_restored:
            report.set_part("rng", "restored", in_file=True)
        elif not plan.source.rng_in_file:
            report.set_part("rng", "absent")
        elif not (asked is True or (asked is None and plan.effective == "remap")):
            report.set_part("rng", "dropped", "restore_rng=False" if asked is False
                            else _why(plan), in_file=True)
        else:  # saved by fewer ranks than this job has: this rank keeps its current RNG
            report.set_part("rng", "absent", f"none saved for rank {_dist.rank()}; its "
                            f"current RNG is kept")


class RuntimePart(Part):
    """The patches' runtime counters (skips, scaler floor escalations, ...), restored under
    ``remap``; counters of another shape are said and left."""

    name = "runtime"

    def plan(self, plan: StatePlan, remap: OptimizerRemap | None, resume_step: bool) -> None:
        saved = plan.source.meta.get("training_patches")
        if plan.effective != "remap":
            return
        plan.runtime = _runtime_state(saved)
        if isinstance(saved, Mapping) and plan.runtime is None:
            logger.warning("training-patches: the runtime counters saved in %s are not in the "
                           "shape this version writes; they were not restored", plan.source.path)

    def apply(self, plan: StatePlan, report: LoadReport, undo: list[Callable[[], None]]) -> None:
        if plan.runtime is None:
            return
        # _api imports every runtime patch; imported from this package it would load (and
        # register) oom_guard before checkpoint, reordering specs() and status()
        from .. import _api  # lazy: import order of the patches (see above)

        undo.append(lambda s=_api.runtime_state(): _api.load_runtime_state(s))
        _api.load_runtime_state(plan.runtime)
        report.runtime_state_restored = True


class DataPart(Part):
    """Each rank's DataLoader position (:mod:`.data_position`): the loader's next ``iter()``
    replays the epoch's start and skips the batches already seen."""

    name = "data"

    def plan(self, plan: StatePlan, remap: OptimizerRemap | None, resume_step: bool) -> None:
        ranks = plan.source.read_data() if plan.source.data_in_file else None
        plan.data, plan.data_part = _plan_data(plan.source, plan.loader, plan.effective,
                                               resume_step, ranks)
        plan.resume_epoch = _resume_epoch(plan.epoch, ranks) if resume_step else 0

    def apply(self, plan: StatePlan, report: LoadReport, undo: list[Callable[[], None]]) -> None:
        if plan.data is not None:
            # the loader's next iter() says here when it starts the epoch over instead
            undo.append(data_position.arm(
                plan.loader, plan.data,
                told=lambda why: report.set_part("data", "reset", why, in_file=True)))

    def report(self, plan: StatePlan, report: LoadReport, resume_step: bool) -> None:
        if plan.data_part is not None:
            report.set_part("data", *plan.data_part, in_file=plan.source.data_in_file)


class EmaPart(Part):
    """The EMA weights (:mod:`.ema`), planned like the model's and refused when they are not
    the same thing; a file's EMA that no ``ema=`` receives is a WARNING."""

    name = "ema"

    def plan(self, plan: StatePlan, remap: OptimizerRemap | None, resume_step: bool) -> None:
        source = plan.source
        if plan.ema is None or not source.ema_in_file:
            return
        try:
            ema_plan = source.plan_ema(plan.ema, plan.model_plan)
        except CheckpointError as exc:
            if "EMA" in str(exc):  # said of the EMA already (ema.module_of)
                raise
            raise CheckpointMismatchError(ema_part.refusal(source.path, plan.ema, str(exc))) \
                from None
        if ema_plan is None:
            return
        model_state = getattr(plan.model_plan, "state", None)
        other = ema_part.other_shapes(plan.ema, model_state) if isinstance(
            model_state, Mapping) else []
        if other:
            raise CheckpointMismatchError(
                f"training-patches: cannot load the EMA weights of {source.path} into "
                f"ema={ema_part.describe(plan.ema)}: its averaged copy does not have the "
                f"model's shapes ({'; '.join(other[:4])}{'; ...' if len(other) > 4 else ''}). "
                f"The EMA was built before the model was resized, so its copy would stay at the "
                f"old size and its next update would fail on it. Nothing was loaded. Build the "
                f"EMA from the model once the model has its final size (ema_pytorch's "
                f"EMA(model) or AveragedModel(model) after resizing), then load again.")
        if not ema_plan.state:
            saved = ema_part.saved_ema(source.meta) or {}
            raise CheckpointMismatchError(
                f"training-patches: cannot load the EMA weights of {source.path} into "
                f"ema={ema_part.describe(plan.ema)}: none of the file's {len(saved)} EMA "
                f"tensor(s) ({', '.join(list(saved)[:3])}) is a tensor of its averaged copy, so "
                f"nothing would be loaded. Nothing was loaded. Pass the EMA of this model "
                f"(ema_pytorch's EMA, torch's AveragedModel or the averaged copy), or leave "
                f"ema= out.")
        plan.ema_plan = ema_plan
        plan.ema_counters = ema_part.counters_plan(plan.ema, ema_part.saved_counters(source.meta))

    def apply(self, plan: StatePlan, report: LoadReport, undo: list[Callable[[], None]]) -> None:
        if plan.ema_plan is None:
            return
        ema = plan.ema
        module = ema_part.averaged_of(ema)
        undo.append(lambda s={k: v.clone() for k, v in ema.state_dict().items()}:
                    ema.load_state_dict(s))
        module.load_state_dict(plan.ema_plan.state, strict=False)
        values, _ = plan.ema_counters or ({}, [])
        buffers = dict(ema.named_buffers(recurse=False))
        with torch.no_grad():
            for name, value in values.items():
                buffers[name].copy_(value)

    def report(self, plan: StatePlan, report: LoadReport, resume_step: bool) -> None:
        counters = (plan.ema_counters or ({}, []))[1]
        said = ema_part.part(plan.ema_plan, plan.ema is not None, plan.source.ema_in_file,
                             counters)
        if said is None:
            return
        report.set_part("ema", *said, in_file=plan.source.ema_in_file)
        if said == ("dropped", "no ema passed"):
            # an EMA kept on rank 0 alone (F5-TTS, most DDP loops): the other ranks pass none
            say = logger.warning if _dist.rank() == 0 else logger.info
            say(
                "training-patches: %s holds EMA weights and load_checkpoint got no ema=: they were "
                "not loaded, so an EMA built for this run starts again from the model's weights "
                "(the average of the run so far is lost). Pass ema= (ema_pytorch's EMA, torch's "
                "AveragedModel, or the averaged copy) to load them.", plan.source.path)


# The parts of a checkpoint, in the order they are decided and reported; applied in it
# too, but the model (``apply_last``) after the others.
UNITS: tuple[Part, ...] = (ModelPart(), OptimizerPart(), SchedulerPart(), ScalerPart(),
                           StepPart(), RngPart(), RuntimePart(), DataPart(), EmaPart())


def plan_state(source: Source, *, policy: str, restore_rng: bool | None, optimizers: list[Any],
               schedulers: list[Any], scaler: Any,
               remap_optimizers: OptimizerRemap | None, loader: Any = None,
               resume_step: bool = True, ema: Any = None) -> StatePlan:
    """Decide every part, the model first (it may refuse; nothing is changed).
    ``remap_optimizers``: None for a source that loads the moments itself."""
    path, meta = source.path, source.meta
    saved_scheds = _as_list(meta.get("scheduler"))
    extra = _extra_of(path, meta)
    saved_step = _step_of(path, meta) if any(meta.get(k) is not None for k in STEP_KEYS) else None
    epoch = meta.get("epoch")
    effective = policy
    if policy == "remap" and optimizers and not source.has_optimizer:
        effective = "reset"  # nothing to keep: the matched set starts fresh together
    plan = StatePlan(
        loader=loader, source=source, policy=policy, effective=effective, optimizers=optimizers,
        schedulers=schedulers, scaler=scaler, scaler_on=scaler_enabled(scaler),
        saved_scheds=saved_scheds, saved_scaler=meta.get("scaler"), optimizer_states=None,
        moments_resized=[], saved_step=saved_step,
        epoch=epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None,
        extra=dict(extra or {}), rng=None, asked_rng=restore_rng, runtime=None, ema=ema,
        resume_step=resume_step)
    for part in UNITS:
        part.plan(plan, remap_optimizers, resume_step)
    return plan


def _resume_epoch(epoch: int | None, ranks: list[Any] | None) -> int:
    """The epoch a training loop continues at: the saved ``epoch`` (else the data position's,
    else 0), or the next one when this rank's saved position had ended that epoch."""
    ranks = ranks or []
    position = ranks[min(_dist.rank(), len(ranks) - 1)] if ranks else None
    plain = isinstance(position, Mapping) and position.get("kind") == data_position.KIND_PLAIN
    if epoch is None:
        epoch = int(position["epoch"]) if plain else 0
    length = position.get("length") if plain else None
    complete = plain and isinstance(length, int) and int(position["batches"]) >= length
    return epoch + 1 if complete else epoch


def _plan_data(source: Source, loader: Any, effective: str, resume_step: bool,
               ranks: list[Any] | None = None,
               ) -> tuple[Mapping[str, Any] | None, tuple[str, str] | None]:
    """(the position to arm ``loader`` with, the data part's (status, detail)); None for the
    part when there is neither a saved position nor a loader. ``ranks``: every rank's saved
    position, when already read."""
    if not source.data_in_file:
        return None, (None if loader is None else (
            "absent", f"the {source.kind} holds no data position; the loader starts as it is"))
    if loader is None:
        return None, ("dropped", "no loader passed")
    if effective == "reset" or not resume_step:
        why = "policy reset" if effective == "reset" else "a weights-only start counts from 0"
        return None, ("dropped", f"{why}: the loader starts as it is")
    ranks = (ranks if ranks is not None else source.read_data()) or []
    rank, world = _dist.rank(), max(_dist.world_size(), 1)
    if len(ranks) != world:
        logger.warning("training-patches: %s holds the data positions of %d rank(s) and this job "
                       "has %d: the data position is not restored, each loader starts its epoch "
                       "from the beginning (the sampler shards the data by the number of ranks)",
                       source.path, len(ranks), world)
        return None, ("dropped", f"saved by {len(ranks)} rank(s), this job has {world}")
    if ranks[rank] is None:
        return None, ("absent", f"none saved for rank {rank}; its loader starts as it is")
    try:
        data, status, detail = data_position.plan(loader, ranks[rank], str(source.path))
    except ValueError as exc:
        raise CheckpointMismatchError(str(exc)) from None
    return data, (status, detail)


def _extra_of(path: Path, meta: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The caller's ``extra`` dict saved with the checkpoint (None: there is none)."""
    extra = meta.get("extra")
    if extra is not None and not isinstance(extra, Mapping):
        raise CheckpointError(
            f"training-patches: cannot load {path}: its 'extra' is a {type(extra).__name__}, "
            f"expected a dict (what CheckpointManager.save(**extra) writes). Nothing was loaded. "
            f"{_what_to_do(path)}")
    return extra


def _step_of(path: Path, meta: Mapping[str, Any]) -> int:
    key = next((k for k in STEP_KEYS if meta.get(k) is not None), None)
    if key is None:
        return 0
    value = meta[key]
    try:
        if isinstance(value, bool) or (isinstance(value, torch.Tensor) and (
                value.numel() != 1 or value.is_floating_point() or value.is_meta)):
            raise TypeError
        step = operator.index(value.item() if isinstance(value, torch.Tensor) else value)
    except (TypeError, ValueError, RuntimeError):
        step = -1
    if step < 0:
        raise CheckpointError(
            f"training-patches: cannot load {path}: its {key!r} is {str(value)[:40]!r}, expected a "
            f"whole number >= 0. The file is not a checkpoint this library or the coqui Trainer "
            f"wrote, or it was changed. Nothing was loaded. {_what_to_do(path)}")
    return step


def carry_out(plan: StatePlan, gate: Callable[[], None], say: Callable[[LoadReport], None],
              **fields: Any) -> LoadReport:
    """The second half of every load: ``gate()`` (every rank decided), :func:`apply_state`,
    :func:`report_parts`, ``say(report)`` (the source's log lines), :func:`say_fallback`."""
    gate()
    report = LoadReport(path=str(plan.source.path), policy=plan.effective,
                        step=plan.saved_step or 0, saved_step=plan.saved_step, epoch=plan.epoch,
                        resume_epoch=plan.resume_epoch, extra=plan.extra,
                        optimizer_moments_resized=list(plan.moments_resized), **fields)
    apply_state(plan, report)
    report_parts(report, plan, resume_step=plan.resume_step)
    say(report)
    say_fallback(report, plan)
    return report


def apply_state(plan: StatePlan, report: LoadReport) -> None:
    """Carry out every part of ``plan``, the model last, all or nothing: a part that still
    fails puts every change back before one :class:`CheckpointError` is raised."""
    undo: list[Callable[[], None]] = []
    model_touched = False
    try:
        for part in sorted(UNITS, key=lambda p: p.apply_last):
            model_touched = model_touched or part.apply_last
            part.apply(plan, report, undo)
    except Exception as exc:  # noqa: BLE001 - put everything back, then one clear error
        for step_back in reversed(undo):
            try:
                step_back()
            except Exception:  # noqa: BLE001 - keep undoing the rest
                logger.exception("training-patches: could not undo part of a refused load")
        if isinstance(exc, CheckpointError):  # the source said it in full (a DCP load)
            raise
        what = ("The optimizer, scheduler, scaler and RNG were put back as they were, but the "
                "model's weights may be partly changed: build the model again before retrying."
                if model_touched else "Nothing was changed.")
        raise CheckpointError(
            f"training-patches: cannot load {plan.source.path}: torch refused part of it after "
            f"it passed every check ({type(exc).__name__}: {str(exc)[:300]}). {what} "
            f"{_what_to_do(plan.source.path)}") from exc
    if plan.effective != "remap":  # the policy's, not one unit's: the three started together
        report.reset += [name for name, started in (
            ("optimizer", plan.optimizers), ("scheduler", plan.schedulers),
            ("scaler", plan.scaler is not None)) if started]
        report.step = 0
    if not plan.resume_step:
        report.step = 0


def _restore_dict(obj: Any, saved: dict[str, Any]) -> None:
    obj.__dict__.clear()
    obj.__dict__.update(saved)


def report_parts(report: LoadReport, plan: StatePlan, *, resume_step: bool = True) -> None:
    """Fill ``report.parts``: each part's own report, read from the plan and what
    :func:`apply_state` did."""
    for part in UNITS:
        part.report(plan, report, resume_step)


def say_fallback(report: LoadReport, plan: StatePlan) -> None:
    """The WARNING of a ``remap`` that fell back to ``reset`` because the source has no
    optimizer state, when that lost something (a step, a scheduler or scaler state)."""
    lost = report.not_restored()
    others = [n for n in ("scheduler", "scaler") if n in lost]
    if plan.fell_back and (report.saved_step or others):
        logger.warning(
            "training-patches: %s has no optimizer state, so the optimizer, scheduler and "
            "scaler start fresh together (policy 'remap' falls back to 'reset': never a mix) "
            "and the run resumes at step 0 (the %s's step: %s)%s. To resume where it "
            "stopped, save the optimizer state with the weights (CheckpointManager.save(step, "
            "model, optimizer, ...)); to start fresh on purpose, pass policy='reset'.",
            plan.source.path, plan.source.kind, report.saved_step,
            f"; its {and_list(others)} state was not loaded" if others else "")


def and_list(items: Sequence[str]) -> str:
    """``a, b and c``."""
    return ", ".join(items[:-1]) + f" and {items[-1]}" if len(items) > 1 else "".join(items)


__all__ = ["STEP_KEYS", "RNG_KEYS", "Source", "StatePlan", "Part", "ModelSource", "ModelPart",
           "EmaPart", "UNITS", "saved_state", "plan_state", "carry_out", "apply_state",
           "report_parts", "say_fallback", "and_list"]
