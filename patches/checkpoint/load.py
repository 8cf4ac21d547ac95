"""``load_checkpoint``: read, validate, plan, then change the model, optimizer, scheduler
and scaler together, and the :class:`LoadReport` of what it did."""

from __future__ import annotations

import logging
import operator
import os
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from .. import _dist
from .._log import info
from . import _collective
from ._validate import _what_to_do, read_checkpoint
from .errors import CheckpointError, CheckpointMismatchError
from .optimizer import (_as_list, _check_plain_state, _detach_from_file, _remap_optimizer_state,
                        _restart_scaler, _restart_scheduler, restore_optimizer, snapshot_optimizer)
from .plan import _MODEL_KEYS, _Plan, _plan_model, check_finite
from .report import LoadReport, _runtime_state, restarted, set_rng_part
from .rng import capture_rng_state, restore_rng_state, state_for_rank
from .sharded import is_sharded_model, load_sharded

logger = logging.getLogger("training_patches")

POLICIES = ("remap", "reset")


# Where checkpoints keep their step: ours and coqui's "step"; plain loops often
# "global_step" (IndexTTS, transformers-style loops) or "iteration".
STEP_KEYS = ("step", "global_step", "iteration")
# Where they keep RNG states: ours "rng"; trainers' own files often "rng_state".
RNG_KEYS = ("rng", "rng_state")


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


def _restore_dict(obj: Any, saved: dict[str, Any]) -> None:
    obj.__dict__.clear()
    obj.__dict__.update(saved)


def load_checkpoint(
    path: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    scheduler: Any = None,
    scaler: Any = None,
    *,
    policy: str = "remap",
    freeze: bool = True,
    strict: bool = True,
    restore_rng: bool | None = None,
    vocab_modules: Sequence[str] = (),
    start_token_row: str | bool = "auto",
    mmap: bool = True,
    seed: int = 0,
    key_filter: Callable[[str], bool] | None = None,
    verify_hash: bool = True,
    allow_nonfinite: bool = False,
    trusted: bool = False,
    truncate: bool = False,
    collective: bool | None = None,
    resume_step: bool = True,
) -> LoadReport:
    """Load ``path`` into ``model`` (and the optimizer, scheduler, scaler) safely, all or
    nothing.

    Args:
        path: a checkpoint written by :class:`CheckpointManager`, the coqui Trainer, or
            ``torch.save(model.state_dict())``.
        model: the model to fill; its text vocabulary may be larger than the checkpoint's.
        optimizer, scheduler, scaler: one object or a list of them (coqui keeps lists).
        policy: ``"remap"`` keeps the optimizer state (moments of grown parameters are
            grown), the scheduler and the scaler; ``"reset"`` starts all three fresh, the
            scheduler at step 0 with its warmup, and resumes at step 0. Never a mix.
        freeze: after a vocabulary growth, freeze the base rows (``patches.vocab_freeze``).
        strict: refuse keys present on one side only (shape mismatches are always refused).
        restore_rng: restore the saved RNG states (default: yes under ``remap``).
        vocab_modules: names of further modules whose rows are the vocabulary.
        start_token_row: ``"auto"`` (XTTS: move the last row when it is the start token),
            True or False.
        mmap: memory-map the file instead of reading it into memory.
        seed: seed of the noise of new rows (the result is reproducible).
        key_filter: keep only the checkpoint's model keys for which it returns True
            (e.g. drop the DVAE of an XTTS GPTTrainer checkpoint).
        verify_hash: with a manifest beside the file, check its SHA-256 (the size is
            always checked). False skips the hash for speed and logs that it did.
        allow_nonfinite: load NaN/Inf weights and optimizer moments (refused by default;
            buffers may always hold +-Inf, as attention masks do).
        truncate: when the model's vocabulary is SMALLER than the checkpoint's because the
            last token ids were removed, drop exactly those rows (and their optimizer
            moments) instead of refusing; the error without it says which ids they are.
        trusted: for your own legacy files whose pickle holds objects: unpickle with
            ``weights_only=False`` (it can run code), logged as a WARNING. Numpy RNG
            states and scalars load without it.
        collective: agree with the other ranks (below); None: when a process group of
            more than one rank is up. False: this process alone (a call on some ranks only).
        resume_step: False for a weights-only start that counts from step 0 (coqui's
            ``restore_path``, XTTS's ``xtts_checkpoint``): ``report.step`` is 0 and the
            report says the saved step was dropped; :func:`warn_weights_only` then names
            what the file held that the start lost.

    The returned :class:`LoadReport` says in ``parts`` what happened to each part (model,
    optimizer, scheduler, scaler, step, rng: restored / remapped / reset / dropped /
    absent); the one INFO line is built from it. A WARNING names the parts a load lost
    without being asked to: the step and the scheduler/scaler state of a file that has no
    optimizer state (``remap`` then restarts all three). A key prefix stripped or added
    (``module.``, ``_orig_mod.``) and values cast to the model's dtypes (a bf16 file, an
    fp32 model) each get an INFO line. A safetensors file is read through the
    ``safetensors`` package.

    Every tensor is validated before anything is touched: present, with data (not
    meta), the planned shape and kind of dtype, and finite. A refused load leaves the
    model, optimizer, scheduler, scaler and RNG exactly as they were.

    Many processes: with a process group of more than one rank call it from EVERY rank.
    Each rank reads and validates the file; only when every rank passed does any of them
    change its model, and a refusal on one rank is raised, the same, on all of them. Each
    rank gets its own saved RNG state back (``rng_ranks``; with another number of ranks
    the log says what was done). A sharded checkpoint (the folder an FSDP2 save writes)
    loads through ``torch.distributed.checkpoint`` into any number of ranks; a single-file
    checkpoint is refused for an FSDP2 (DTensor) model, with what to do instead.

    Raises:
        UnsafeCheckpointError, CheckpointError, CheckpointMismatchError: before anything
        was changed.
    """
    if policy not in POLICIES:
        raise ValueError(f"load_checkpoint: policy must be one of {POLICIES}, got {policy!r}")
    path = Path(path)
    if path.is_dir():
        return load_sharded(path, model, optimizer, scheduler, scaler, policy=policy,
                            restore_rng=restore_rng, verify_hash=verify_hash,
                            allow_nonfinite=allow_nonfinite)
    if is_sharded_model(model):
        raise CheckpointError(
            f"training-patches: cannot load the single-file checkpoint {path} into this model: "
            f"its parameters are DTensors (sharded by FSDP2 fully_shard or tensor parallelism), "
            f"and the vocabulary-aware loader plans, validates and grows whole tensors, which "
            f"would mean gathering every parameter and optimizer moment on every rank. Nothing "
            f"was loaded. Load the file into the model BEFORE sharding it (build the model, "
            f"call load_checkpoint(path, model) on every rank, then fully_shard, then create "
            f"the optimizer), or resume from a sharded checkpoint folder that "
            f"CheckpointManager.save wrote for this FSDP2 model (CheckpointManager.resume('auto') "
            f"finds it).")
    args = dict(policy=policy, freeze=freeze, strict=strict, restore_rng=restore_rng,
                vocab_modules=vocab_modules, start_token_row=start_token_row, mmap=mmap,
                seed=seed, key_filter=key_filter, verify_hash=verify_hash,
                allow_nonfinite=allow_nonfinite, trusted=trusted, truncate=truncate,
                resume_step=resume_step)
    if collective is False or not _collective.active():
        return _load_file(path, model, optimizer, scheduler, scaler, gate=None, **args)
    return _collective.on_every_rank(
        lambda gate: _load_file(path, model, optimizer, scheduler, scaler, gate=gate, **args))


def _load_file(path: Path, model: torch.nn.Module, optimizer: Any, scheduler: Any,
               scaler: Any, *, gate: Callable[[], None] | None, policy: str, freeze: bool,
               strict: bool, restore_rng: bool | None, vocab_modules: Sequence[str],
               start_token_row: str | bool, mmap: bool, seed: int,
               key_filter: Callable[[str], bool] | None, verify_hash: bool,
               allow_nonfinite: bool, trusted: bool, truncate: bool,
               resume_step: bool = True) -> LoadReport:
    """:func:`load_checkpoint` of one file on this rank; ``gate()`` (every rank together)
    runs after every check and before the first change."""
    ckpt = read_checkpoint(path, mmap=mmap, verify_hash=verify_hash, trusted=trusted)
    plan = _plan_model(path, ckpt, model, strict=strict, vocab_modules=vocab_modules,
                       start_token_row=start_token_row, seed=seed, key_filter=key_filter,
                       truncate=truncate)
    if not allow_nonfinite:
        check_finite(path, plan, model)
    # A bare state dict has no step, optimizer, ... (its keys are tensor names).
    bare = not any(isinstance(ckpt.get(k), Mapping) for k in _MODEL_KEYS)
    meta: Mapping[str, Any] = {} if bare else ckpt
    optimizers = _as_list(optimizer)
    schedulers = [s for s in _as_list(scheduler) if s is not None]
    saved_opts = _as_list(meta.get("optimizer"))
    saved_scheds = _as_list(meta.get("scheduler"))
    saved_scaler = meta.get("scaler")
    extra = meta.get("extra")
    if extra is not None and not isinstance(extra, Mapping):
        raise CheckpointError(
            f"training-patches: cannot load {path}: its 'extra' is a {type(extra).__name__}, "
            f"expected a dict (what CheckpointManager.save(**extra) writes). Nothing was loaded. "
            f"{_what_to_do(path)}")
    saved_step = (_step_of(path, meta) if any(meta.get(k) is not None for k in STEP_KEYS)
                  else None)
    report = LoadReport(path=str(path), policy=policy, step=saved_step or 0, saved_step=saved_step,
                        epoch=meta.get("epoch") if isinstance(meta.get("epoch"), int)
                        and not isinstance(meta.get("epoch"), bool) else None,
                        extra=dict(extra or {}), checkpoint=ckpt)

    # Decide and validate everything before changing anything: a refusal leaves the
    # user's objects as they were.
    effective = policy
    remapped: list[dict[str, Any]] = []
    if policy == "remap" and optimizers:
        if not saved_opts:
            effective = "reset"  # nothing to keep: the matched set starts fresh together
        elif len(saved_opts) != len(optimizers):
            raise CheckpointMismatchError(
                f"training-patches: {path} holds the state of {len(saved_opts)} optimizer(s), "
                f"{len(optimizers)} were given. Nothing was loaded. Pass the same optimizers, or "
                f"use policy='reset' to start the optimizer, scheduler and scaler fresh.")
        else:
            names = {id(p): n for n, p in model.named_parameters()}
            for saved, opt in zip(saved_opts, optimizers):
                state, resized = _remap_optimizer_state(path, saved, opt, names, plan,
                                                        allow_nonfinite=allow_nonfinite)
                remapped.append(state)
                report.optimizer_moments_resized += [r for r in resized
                                                     if r not in report.optimizer_moments_resized]
    if effective == "remap" and schedulers and saved_scheds:
        if len(saved_scheds) < len(schedulers):
            raise CheckpointMismatchError(
                f"training-patches: {path} holds {len(saved_scheds)} scheduler state(s), "
                f"{len(schedulers)} schedulers were given. Nothing was loaded. Use policy='reset'.")
        for state, sched in zip(saved_scheds, schedulers):
            _check_plain_state(path, "scheduler", state, sched)
    scaler_on = scaler is not None and getattr(scaler, "_enabled", True)
    if effective == "remap" and scaler_on and saved_scaler:
        _check_plain_state(path, "scaler", saved_scaler, scaler)
    asked_rng = restore_rng
    if restore_rng is None:
        restore_rng = effective == "remap"
    rng = next((meta[k] for k in RNG_KEYS if isinstance(meta.get(k), Mapping)), None)
    rng_ranks = meta.get("rng_ranks")
    if restore_rng and isinstance(rng_ranks, list) and rng_ranks:
        # Every rank's state was saved: each rank takes its own.
        rng = state_for_rank(rng_ranks, _dist.rank(), max(_dist.world_size(), 1), str(path))
    rng_in_file = rng is not None or (isinstance(rng_ranks, list) and bool(rng_ranks))
    rng = rng if restore_rng else None
    runtime = _runtime_state(meta.get("training_patches")) if effective == "remap" else None
    if effective == "remap" and isinstance(meta.get("training_patches"), Mapping) and runtime is None:
        logger.warning("training-patches: the runtime counters saved in %s are not in the shape "
                       "this version writes; they were not restored", path)

    if gate is not None:
        gate()  # every rank passed every check; a refusal on any rank stops all of them here

    # Apply, with an undo for each change: if torch still refuses something, everything
    # that was changed is put back before the error is raised.
    undo: list[Callable[[], None]] = []
    model_touched = False
    try:
        if effective == "remap":
            for state, opt in zip(remapped, optimizers):
                snap = snapshot_optimizer(opt)
                undo.append(lambda o=opt, s=snap: restore_optimizer(o, s))
                opt.load_state_dict(state)
                _detach_from_file(opt.state)
            if optimizers:
                report.restored.append("optimizer")
            if schedulers and saved_scheds:
                for state, sched in zip(saved_scheds, schedulers):
                    undo.append(lambda o=sched, s=dict(sched.__dict__): _restore_dict(o, s))
                    sched.load_state_dict(dict(state))
                report.restored.append("scheduler")
            elif schedulers:
                report.reset.append("scheduler (not in the checkpoint)")
            if scaler_on:
                if saved_scaler:
                    snap_scaler = scaler.state_dict()
                    if snap_scaler:
                        undo.append(lambda s=snap_scaler: scaler.load_state_dict(s))
                    scaler.load_state_dict(dict(saved_scaler))
                    report.restored.append("scaler")
                else:
                    report.reset.append("scaler (not in the checkpoint)")
        else:
            for opt in optimizers:
                snap = snapshot_optimizer(opt)
                undo.append(lambda o=opt, s=snap: restore_optimizer(o, s))
                opt.state = defaultdict(dict)
                for group in opt.param_groups:
                    if "initial_lr" in group:
                        group["lr"] = group["initial_lr"]
            for sched in schedulers:
                undo.append(lambda o=sched, s=dict(sched.__dict__): _restore_dict(o, s))
                _restart_scheduler(sched)
            if scaler is not None:
                snap_scaler = scaler.state_dict() if getattr(scaler, "_enabled", False) else None
                if snap_scaler:
                    undo.append(lambda s=snap_scaler: scaler.load_state_dict(s))
                _restart_scaler(scaler)
            report.reset += restarted(optimizers, schedulers, scaler)
            report.step = 0
        if rng is not None:
            undo.append(lambda s=capture_rng_state(): restore_rng_state(s))
            restore_rng_state(rng)
            report.rng_restored = True
        if runtime is not None:
            from .. import _api

            undo.append(lambda s=_api.runtime_state(): _api.load_runtime_state(s))
            _api.load_runtime_state(runtime)
            report.runtime_state_restored = True
        # The model last: everything it could refuse was checked above.
        model_touched = True
        missing, unexpected = model.load_state_dict(plan.state, strict=False)
    except Exception as exc:  # noqa: BLE001 - put everything back, then one clear error
        for step_back in reversed(undo):
            try:
                step_back()
            except Exception:  # noqa: BLE001 - keep undoing the rest
                logger.exception("training-patches: could not undo part of a refused load")
        what = ("The optimizer, scheduler, scaler and RNG were put back as they were, but the "
                "model's weights may be partly changed: build the model again before retrying."
                if model_touched else "Nothing was changed.")
        raise CheckpointError(
            f"training-patches: cannot load {path}: torch refused part of it after it passed "
            f"every check ({type(exc).__name__}: {str(exc)[:300]}). {what} "
            f"{_what_to_do(path)}") from exc
    report.missing_keys = sorted(set(missing) | set(plan.missing))
    report.unexpected_keys = list(plan.unexpected)
    report.loaded.append("model")
    if plan.rows is not None:
        report.resized = dict(plan.resized)
        report.kept_rows = {key: min(plan.rows.old_rows, plan.rows.new_rows)
                            for key in plan.resized}
        report.base_vocab_size, report.vocab_size = plan.rows.old_rows, plan.rows.new_rows
        report.start_row_moved = plan.rows.start_row_last
    report.policy = effective if policy == "remap" else policy
    if not resume_step:
        report.step = 0
    if plan.prefix_stripped or plan.prefix_added:
        report.prefix_stripped, report.prefix_added = plan.prefix_stripped, plan.prefix_added
        report.renamed_keys = len(plan.aligned)  # every matched key went through the prefix
    report.dtype_casts = dict(plan.casts)
    if plan.rows is not None and plan.rows.added > 0 and freeze:
        report.freeze = _enable_freeze(model, plan, vocab_modules)
    _set_parts(report, plan, policy=policy, effective=effective, optimizers=optimizers,
               schedulers=schedulers, scaler=scaler, scaler_on=scaler_on, saved_opts=saved_opts,
               saved_scheds=saved_scheds, saved_scaler=saved_scaler, rng_in_file=rng_in_file,
               asked_rng=asked_rng, resume_step=resume_step)
    _say(path, report, plan, fell_back=effective != policy)
    return report


def _set_parts(report: LoadReport, plan: _Plan, *, policy: str, effective: str,
               optimizers: list[Any], schedulers: list[Any], scaler: Any, scaler_on: bool,
               saved_opts: list[Any], saved_scheds: list[Any], saved_scaler: Any,
               rng_in_file: bool, asked_rng: bool | None, resume_step: bool) -> None:
    """Fill ``report.parts`` from what :func:`_load_file` did (read from the plan and the
    decisions it acted on, not from what was asked)."""
    fell_back = effective != policy
    # why a part was started fresh: the policy asked for it, or the file has no optimizer state
    why = "policy reset" if not fell_back else "the file has no optimizer state"
    if plan.rows is not None:
        rows = plan.rows
        change = (f"grown by {rows.added} vocabulary row(s) near the old rows' mean"
                  if rows.added >= 0 else
                  f"cut by their last {-rows.added} vocabulary row(s) (truncate=True)")
        report.set_part("model", "remapped", f"{len(plan.state)} tensor(s), "
                        f"{len(plan.resized)} of them {change}", in_file=True)
    else:
        report.set_part("model", "restored", f"{len(plan.state)} tensor(s)", in_file=True)

    def fresh_or_dropped(name: str, given: bool, in_file: bool, restarted: bool) -> None:
        if restarted:
            detail = "absent in file" if not in_file else (
                f"{why}; the file's state not loaded")
            report.set_part(name, "reset", detail, in_file=in_file)
        elif in_file:
            report.set_part(name, "dropped", f"no {name} passed" if not given
                            else f"the {name} passed is disabled", in_file=True)
        else:
            report.set_part(name, "absent", "left as passed" if given else "")

    if optimizers and effective == "remap":
        n = len(optimizers)
        own = f"{n} optimizers" if n > 1 else ""
        if report.optimizer_moments_resized:
            moments = (f"moments of {len(report.optimizer_moments_resized)} grown parameter(s) "
                       "resized: new rows' first moment 0, second moment the old rows' mean")
            report.set_part("optimizer", "remapped", "; ".join(p for p in (own, moments) if p),
                            in_file=True)
        else:
            report.set_part("optimizer", "restored", own, in_file=True)
    else:
        fresh_or_dropped("optimizer", bool(optimizers), bool(saved_opts), bool(optimizers))
    if schedulers and effective == "remap" and saved_scheds:
        report.set_part("scheduler", "restored", in_file=True)
    else:
        fresh_or_dropped("scheduler", bool(schedulers), bool(saved_scheds),
                         bool(schedulers) and effective == "reset")
    if scaler_on and effective == "remap" and saved_scaler:
        report.set_part("scaler", "restored", in_file=True)
    else:
        fresh_or_dropped("scaler", scaler is not None, bool(saved_scaler),
                         scaler_on and effective == "reset")
    saved = report.saved_step
    if saved is None:
        report.set_part("step", "absent", "resuming at 0")
    elif effective == "reset":
        report.set_part("step", "reset", f"saved {saved}, resuming at 0: {why}", in_file=True)
    elif not resume_step:
        report.set_part("step", "dropped", f"saved {saved}; a weights-only start counts from 0",
                        in_file=True)
    else:
        report.set_part("step", "restored", in_file=True)
    set_rng_part(report, in_file=rng_in_file, asked=asked_rng, why=why, rank=_dist.rank(),
                 restore=asked_rng is True or (asked_rng is None and effective == "remap"))


def _say(path: Path, report: LoadReport, plan: _Plan, *, fell_back: bool) -> None:
    """The log lines of a load, every one read from ``report`` (and the plan it acted on)."""
    if report.renamed_keys:
        how = " and ".join(
            [f"stripped the prefix {report.prefix_stripped!r} from"] * bool(report.prefix_stripped)
            + [f"added the prefix {report.prefix_added!r} to"] * bool(report.prefix_added))
        info("training-patches: %s: %s %d key(s) of the file to match the model's names "
             "(e.g. %s -> %s)", path, how, report.renamed_keys,
             *next(iter((ck, key) for key, ck in plan.aligned.items())))
    if report.dtype_casts:
        pairs: dict[tuple[str, str], int] = {}
        for pair in report.dtype_casts.values():
            pairs[pair] = pairs.get(pair, 0) + 1
        info("training-patches: %s: %d tensor(s) were cast to the model's dtypes (%s); the "
             "values loaded are the cast ones", path, len(report.dtype_casts),
             ", ".join(f"{n} {a} -> {b}" for (a, b), n in sorted(pairs.items())))
    info("training-patches: %s", report.summary())
    lost = report.not_restored()
    others = [n for n in ("scheduler", "scaler") if n in lost]
    if fell_back and (report.saved_step or others):
        logger.warning(
            "training-patches: %s has no optimizer state, so the optimizer, scheduler and "
            "scaler start fresh together (policy 'remap' falls back to 'reset': never a mix) "
            "and the run resumes at step 0 (the file's step: %s)%s. To resume where it "
            "stopped, save the optimizer state with the weights (CheckpointManager.save(step, "
            "model, optimizer, ...)); to start fresh on purpose, pass policy='reset'.", path,
            report.saved_step, f"; its {_and(others)} state was not loaded"
            if others else "")


def warn_weights_only(report: LoadReport, why: str, hint: str) -> bool:
    """For a weights-only start (``resume_step=False``): one WARNING naming the training
    state the file holds that the load did not restore (optimizer, scheduler, scaler
    state, a step > 0), with ``why`` (who dropped it) and ``hint`` (how to resume
    instead). Nothing is logged, and False returned, when the file held none of it."""
    lost = report.not_restored()
    held = [f"step {report.saved_step}" if name == "step" else f"{name} state"
            for name in lost if name in ("optimizer", "scheduler", "scaler")
            or (name == "step" and report.saved_step)]
    if not held:
        return False
    logger.warning("training-patches: %s holds %s that this load did not restore: %s. The "
                   "optimizer starts with no saved moments and the step counts from 0. %s",
                   report.path, _and(held), why, hint)
    return True


def _and(items: Sequence[str]) -> str:
    return ", ".join(items[:-1]) + f" and {items[-1]}" if len(items) > 1 else "".join(items)


def _enable_freeze(model: torch.nn.Module, plan: _Plan, vocab_modules: Sequence[str]) -> Any:
    """Freeze the base rows of the grown vocabulary (lazy: vocab_freeze may be absent)."""
    try:
        from .. import vocab_freeze
    except ImportError:
        logger.warning(
            "training-patches: the vocabulary grew from %d to %d rows but patches.vocab_freeze is "
            "not available, so the base rows are not frozen.", plan.rows.old_rows, plan.rows.new_rows)
        return None
    modules = sorted({key.rsplit(".", 1)[0] for key in plan.resized})
    base_rows = _base_rows(model, plan, modules)
    return vocab_freeze.freeze_base_vocab(model, base_rows, modules=modules,
                                          start_row_last=plan.rows.start_row_last)


def _base_rows(model: torch.nn.Module, plan: _Plan, modules: Sequence[str]) -> int:
    """Rows of the BASE vocabulary to freeze after a growth: not every row of the checkpoint
    (rows already trained for the new language keep training), but the first
    ``TRAINING_PATCHES_BASE_VOCAB`` tokens (in the model's row layout), else the base of a
    freeze already on these modules, else, when neither is known, every old row (logged)."""
    from .. import _options, vocab_freeze

    old_rows = plan.rows.old_rows
    owner_path = modules[0].rsplit(".", 1)[0] if "." in modules[0] else ""
    owner = model.get_submodule(owner_path) if owner_path else model
    tokens = _options.current().base_vocab
    if tokens:
        rows = vocab_freeze.row_layout(owner, plan.rows.new_rows).base_rows(tokens)
        return min(rows, old_rows)
    for name in modules:
        for param in model.get_submodule(name).parameters():
            handle = vocab_freeze.freeze_of(param)
            if handle is not None:
                return min(handle.base_vocab_size, old_rows)
    logger.info("training-patches: the base vocabulary size is not known, so all %d rows of "
                "the checkpoint are frozen; set TRAINING_PATCHES_BASE_VOCAB to the tokens of "
                "the original tokenizer to let rows trained for the new language train on",
                old_rows)
    return old_rows
