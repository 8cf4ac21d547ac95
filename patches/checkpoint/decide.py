"""The decide phase of a single-file load: :func:`decide` reads the file, plans the model's
tensors (keys matched, rows grown, every tensor checked), then the optimizer, scheduler,
scaler, step, RNG and runtime counters, into one :class:`LoadPlan`. It raises before
anything is changed and changes none of the objects it is given; :mod:`.apply` carries
the plan out."""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from .. import _dist, _options
from ..row_init import check_rule

from .errors import CheckpointError, CheckpointMismatchError
from .optimizer import (_as_list, _check_plain_state, _remap_optimizer_state, check_kinds,
                        scaler_enabled)
from .plan import MODEL_KEYS, ModelPlan, check_finite, plan_model
from .reading import _what_to_do, read_checkpoint
from .report import _runtime_state
from .rng import state_for_rank

logger = logging.getLogger("training_patches")

# Where checkpoints keep their step: ours and coqui's "step"; plain loops often
# "global_step" (IndexTTS, transformers-style loops) or "iteration".
STEP_KEYS = ("step", "global_step", "iteration")
# Where they keep RNG states: ours "rng"; trainers' own files often "rng_state".
RNG_KEYS = ("rng", "rng_state")


@dataclass(frozen=True)
class LoadOptions:
    """How :func:`~patches.checkpoint.load_checkpoint` loads (its docstring says what each
    field does). Pass one as ``options=``, or any field as a keyword (a keyword wins over
    ``options``); ``dataclasses.replace(options, seed=1)`` makes a changed copy.
    ``row_init``/``head_row_init`` None: ``TRAINING_PATCHES_ROW_INIT`` /
    ``TRAINING_PATCHES_HEAD_ROW_INIT`` at the time of the load."""

    policy: str = "remap"
    freeze: bool = True
    strict: bool = True
    restore_rng: bool | None = None
    vocab_modules: Sequence[str] = ()
    start_token_row: str | bool = "auto"
    mmap: bool = True
    seed: int = 0
    key_filter: Callable[[str], bool] | None = None
    verify_hash: bool = True
    allow_nonfinite: bool = False
    trusted: bool = False
    truncate: bool = False
    resume_step: bool = True
    row_init: str | None = None
    head_row_init: str | None = None
    tokenizer: Any = None
    collective: bool | None = None

    # What a sharded (DCP) folder can honour: it loads tensors of the saved shapes into the
    # same sharded model, so the single file's vocabulary, key and pickle options do not apply.
    # (It is collective by nature: every rank loads its shards together, so of ``collective``
    # only False, one process alone, cannot be honoured.)
    FOLDER_FIELDS = ("policy", "restore_rng", "verify_hash", "allow_nonfinite")

    def resolved(self) -> "LoadOptions":
        """A copy whose row rules are named and checked (None: the current settings)."""
        current = _options.current()
        return replace(self, row_init=check_rule(
            current.row_init if self.row_init is None else self.row_init),
            head_row_init=check_rule(current.head_row_init if self.head_row_init is None
                                     else self.head_row_init, "head_row_init"))


@dataclass
class LoadPlan:
    """Everything a load of one file will do, decided and validated before any change.

    ``effective`` is the policy carried out: ``remap`` falls back to ``reset`` when the
    file has no optimizer state (the optimizer, scheduler and scaler then start fresh
    together). ``optimizer_states`` holds, under ``remap``, each optimizer's saved state
    with its moments grown; ``rng`` the RNG state to restore on this rank (None: keep
    the current one); ``runtime`` the runtime counters to restore (None: keep them).
    """

    path: Path
    checkpoint: dict[str, Any]
    model: ModelPlan
    policy: str
    effective: str
    optimizers: list[Any]
    schedulers: list[Any]
    scaler: Any
    scaler_on: bool  # a scaler was passed and is enabled
    saved_opts: list[Any]
    saved_scheds: list[Any]
    saved_scaler: Any
    optimizer_states: list[dict[str, Any]]
    moments_resized: list[str]
    saved_step: int | None
    epoch: int | None
    extra: dict[str, Any]
    rng: Mapping[str, Any] | None
    rng_in_file: bool
    asked_rng: bool | None
    runtime: dict[str, dict[str, float]] | None

    @property
    def fell_back(self) -> bool:
        """``remap`` was asked and the file has no optimizer state: all three start fresh."""
        return self.effective != self.policy


def decide(path: Path, model: torch.nn.Module, optimizer: Any, scheduler: Any, scaler: Any,
           options: LoadOptions) -> LoadPlan:
    """The :class:`LoadPlan` of loading the file ``path`` into these objects: read, validate,
    plan the rows, plan the optimizer state (in that order: the first problem found is the
    one raised). Raises :class:`CheckpointError` or :class:`CheckpointMismatchError`;
    nothing passed in is changed."""
    options = options.resolved()
    ckpt = read_checkpoint(path, mmap=options.mmap, verify_hash=options.verify_hash,
                           trusted=options.trusted)
    plan = plan_model(path, ckpt, model, strict=options.strict,
                      vocab_modules=options.vocab_modules,
                      start_token_row=options.start_token_row, seed=options.seed,
                      key_filter=options.key_filter, truncate=options.truncate,
                      row_init=options.row_init, head_row_init=options.head_row_init,
                      tokenizer=options.tokenizer)
    if not options.allow_nonfinite:
        check_finite(path, plan, model)
    # A bare state dict has no step, optimizer, ... (its keys are tensor names).
    bare = not any(isinstance(ckpt.get(k), Mapping) for k in MODEL_KEYS)
    meta: Mapping[str, Any] = {} if bare else ckpt
    optimizers = _as_list(optimizer)
    schedulers = [s for s in _as_list(scheduler) if s is not None]
    saved_opts = _as_list(meta.get("optimizer"))
    saved_scheds = _as_list(meta.get("scheduler"))
    saved_scaler = meta.get("scaler")
    extra = _extra_of(path, meta)
    saved_step = (_step_of(path, meta) if any(meta.get(k) is not None for k in STEP_KEYS)
                  else None)
    epoch = meta.get("epoch")
    if options.policy == "remap":  # a state of another class is refused, never "restored"
        check_kinds(path, meta, optimizers, saved_opts, schedulers, saved_scheds)
    effective, states, resized = _plan_optimizers(path, model, plan, options, optimizers,
                                                  saved_opts)
    if effective == "remap" and schedulers and saved_scheds:
        if len(saved_scheds) < len(schedulers):
            raise CheckpointMismatchError(
                f"training-patches: {path} holds {len(saved_scheds)} scheduler state(s), "
                f"{len(schedulers)} schedulers were given. Nothing was loaded. Use policy='reset'.")
        for state, sched in zip(saved_scheds, schedulers):
            _check_plain_state(path, "scheduler", state, sched)
    scaler_on = scaler_enabled(scaler)
    if effective == "remap" and scaler_on and saved_scaler:
        _check_plain_state(path, "scaler", saved_scaler, scaler)
    rng, rng_in_file = _plan_rng(path, meta, options.restore_rng, effective)
    runtime = _runtime_state(meta.get("training_patches")) if effective == "remap" else None
    if effective == "remap" and isinstance(meta.get("training_patches"), Mapping) and runtime is None:
        logger.warning("training-patches: the runtime counters saved in %s are not in the shape "
                       "this version writes; they were not restored", path)
    return LoadPlan(
        path=path, checkpoint=ckpt, model=plan, policy=options.policy, effective=effective,
        optimizers=optimizers, schedulers=schedulers, scaler=scaler, scaler_on=scaler_on,
        saved_opts=saved_opts, saved_scheds=saved_scheds, saved_scaler=saved_scaler,
        optimizer_states=states, moments_resized=resized, saved_step=saved_step,
        epoch=epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None,
        extra=dict(extra or {}), rng=rng, rng_in_file=rng_in_file,
        asked_rng=options.restore_rng, runtime=runtime)


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


def _plan_optimizers(path: Path, model: torch.nn.Module, plan: ModelPlan, options: LoadOptions,
                     optimizers: list[Any], saved_opts: list[Any],
                     ) -> tuple[str, list[dict[str, Any]], list[str]]:
    """(the policy carried out, each optimizer's state to load under ``remap`` with its
    moments grown, the names of the parameters whose moments were resized)."""
    effective = options.policy
    states: list[dict[str, Any]] = []
    resized: list[str] = []
    if options.policy != "remap" or not optimizers:
        return effective, states, resized
    if not saved_opts:
        return "reset", states, resized  # nothing to keep: the matched set starts fresh together
    if len(saved_opts) != len(optimizers):
        raise CheckpointMismatchError(
            f"training-patches: {path} holds the state of {len(saved_opts)} optimizer(s), "
            f"{len(optimizers)} were given. Nothing was loaded. Pass the same optimizers, or "
            f"use policy='reset' to start the optimizer, scheduler and scaler fresh.")
    names = {id(p): n for n, p in model.named_parameters()}
    for saved, opt in zip(saved_opts, optimizers):
        state, grown = _remap_optimizer_state(path, saved, opt, names, plan,
                                              allow_nonfinite=options.allow_nonfinite)
        states.append(state)
        resized += [r for r in grown if r not in resized]
    return effective, states, resized


def _plan_rng(path: Path, meta: Mapping[str, Any], asked: bool | None,
              effective: str) -> tuple[Mapping[str, Any] | None, bool]:
    """(the RNG state this rank restores or None, whether the file holds RNG states).
    ``asked`` None: restore under ``remap`` only."""
    restore = (effective == "remap") if asked is None else asked
    rng = next((meta[k] for k in RNG_KEYS if isinstance(meta.get(k), Mapping)), None)
    rng_ranks = meta.get("rng_ranks")
    if restore and isinstance(rng_ranks, list) and rng_ranks:
        # Every rank's state was saved: each rank takes its own.
        rng = state_for_rank(rng_ranks, _dist.rank(), max(_dist.world_size(), 1), str(path))
    in_file = rng is not None or (isinstance(rng_ranks, list) and bool(rng_ranks))
    return (rng if restore else None), in_file
