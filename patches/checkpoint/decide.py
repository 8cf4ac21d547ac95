"""The decide phase of a single-file load: :func:`decide` reads the file into a
:class:`~.parts.Source` (its model part a :class:`.file_model.FileModel`) and plans every
part into one :class:`LoadPlan`, changing nothing; :func:`.parts.carry_out` carries it out.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from .. import _dist, _options
from ..row_init import check_rule

from . import ema as ema_part
from .errors import CheckpointMismatchError
from .file_model import FileModel, plan_tensors
from .optimizer import _as_list, _remap_optimizer_state
from .parts import RNG_KEYS, STEP_KEYS, Source, StatePlan, plan_state
from .plan import MODEL_KEYS, ModelPlan
from .reading import open_checkpoint
from .rng import state_for_rank

logger = logging.getLogger("training_patches")

__all__ = ["LoadOptions", "LoadPlan", "decide", "STEP_KEYS", "RNG_KEYS"]


@dataclass(frozen=True)
class LoadOptions:
    """How :func:`~patches.checkpoint.load_checkpoint` loads (its docstring says what each
    field does). Pass one as ``options=``, or any field as a keyword (a keyword wins).
    ``row_init``/``head_row_init`` None: the settings' (:func:`patches._options.current`)."""

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
    loader: Any = None
    ema: Any = None

    # What a sharded (DCP) folder can honour: it loads tensors of the saved shapes into the
    # same sharded model, so the single file's vocabulary, key and pickle options do not apply.
    # (It is collective by nature: every rank loads its shards together, so of ``collective``
    # only False, one process alone, cannot be honoured.)
    FOLDER_FIELDS = ("policy", "restore_rng", "verify_hash", "allow_nonfinite", "loader")

    def resolved(self) -> "LoadOptions":
        """A copy whose row rules are named and checked (None: the current settings)."""
        current = _options.current()
        return replace(self, row_init=check_rule(
            current.row_init if self.row_init is None else self.row_init),
            head_row_init=check_rule(current.head_row_init if self.head_row_init is None
                                     else self.head_row_init, "head_row_init"))


@dataclass
class LoadPlan:
    """Everything a load of one file will do, decided and validated before any change: the
    model's tensors (:class:`ModelPlan`) and the parts beside them (:class:`StatePlan`,
    the plan a sharded folder's load makes too)."""

    path: Path
    checkpoint: dict[str, Any]
    state: StatePlan

    @property
    def model(self) -> ModelPlan:
        """The model's tensors to load (the model part's plan)."""
        return self.state.model_plan

    @property
    def policy(self) -> str:
        return self.state.policy

    @property
    def effective(self) -> str:
        """The policy carried out (``remap`` falls back to ``reset`` without optimizer state)."""
        return self.state.effective

    @property
    def saved_step(self) -> int | None:
        return self.state.saved_step

    @property
    def rng(self) -> Mapping[str, Any] | None:
        return self.state.rng


def decide(path: Path, model: torch.nn.Module, optimizer: Any, scheduler: Any, scaler: Any,
           options: LoadOptions) -> LoadPlan:
    """The :class:`LoadPlan` of loading the file ``path`` into these objects: read, validate,
    plan the rows, the optimizer state and the other parts (the first problem found is
    raised; nothing passed in is changed). The digest is read in threads meanwhile (issue
    41) and waited for before the plan is returned, or before a failure is raised."""
    options = options.resolved()
    ckpt, verification = open_checkpoint(path, mmap=options.mmap,
                                         verify_hash=options.verify_hash,
                                         trusted=options.trusted)
    plan = verification.around(
        lambda: _decide(path, ckpt, model, optimizer, scheduler, scaler, options))
    verification.wait()
    return plan


def _decide(path: Path, ckpt: dict[str, Any], model: torch.nn.Module, optimizer: Any,
            scheduler: Any, scaler: Any, options: LoadOptions) -> LoadPlan:
    # A bare state dict has no step, optimizer, ... (its keys are tensor names).
    bare = not any(isinstance(ckpt.get(k), Mapping) for k in MODEL_KEYS)
    meta: Mapping[str, Any] = {} if bare else ckpt
    optimizers = _as_list(optimizer)
    saved_opts = _as_list(meta.get("optimizer"))
    saved_ema = ema_part.saved_ema(meta)
    source = Source(path=path, kind="file", meta=meta, has_optimizer=bool(saved_opts),
                    read_rng=lambda: _saved_rng(path, meta), rng_in_file=_holds_rng(meta),
                    model=FileModel(path, ckpt, model, options),
                    saved_optimizers=saved_opts, read_data=lambda: list(meta["data_ranks"]),
                    data_in_file=isinstance(meta.get("data_ranks"), list),
                    plan_ema=lambda ema, model_plan: _plan_ema(path, saved_ema, ema, model_plan,
                                                               options),
                    ema_in_file=saved_ema is not None)
    state = plan_state(
        source, policy=options.policy, restore_rng=options.restore_rng, optimizers=optimizers,
        schedulers=[s for s in _as_list(scheduler) if s is not None], scaler=scaler,
        remap_optimizers=lambda plan: _remap_optimizers(path, model, plan.model_plan, options,
                                                        optimizers, saved_opts),
        loader=options.loader, resume_step=options.resume_step, ema=options.ema)
    return LoadPlan(path=path, checkpoint=ckpt, state=state)


def _plan_ema(path: Path, saved: Mapping[str, Any], ema: Any, model_plan: ModelPlan,
              options: LoadOptions) -> ModelPlan:
    """The plan of the file's EMA weights ``saved`` into ``ema``: matched, checked and grown
    like the model's, new rows as the model's (:mod:`.ema`)."""
    try:
        module = ema_part.module_of(ema, path)
    except ValueError as exc:
        raise CheckpointMismatchError(str(exc)) from None
    ema_plan = plan_tensors(path, {"model": saved}, module, options)
    ema_part.start_new_rows_as_the_model(ema_plan, model_plan)
    return ema_plan


def _remap_optimizers(path: Path, model: torch.nn.Module, plan: ModelPlan, options: LoadOptions,
                      optimizers: list[Any], saved_opts: list[Any],
                      ) -> tuple[list[dict[str, Any]], list[str]]:
    """(each optimizer's saved state with its moments grown onto the model's rows, the
    names of the parameters whose moments were resized)."""
    if len(saved_opts) != len(optimizers):
        raise CheckpointMismatchError(
            f"training-patches: {path} holds the state of {len(saved_opts)} optimizer(s), "
            f"{len(optimizers)} were given. Nothing was loaded. Pass the same optimizers, or "
            f"use policy='reset' to start the optimizer, scheduler and scaler fresh.")
    states: list[dict[str, Any]] = []
    resized: list[str] = []
    names = {id(p): n for n, p in model.named_parameters()}
    for saved, opt in zip(saved_opts, optimizers):
        state, grown = _remap_optimizer_state(path, saved, opt, names, plan,
                                              allow_nonfinite=options.allow_nonfinite)
        states.append(state)
        resized += [r for r in grown if r not in resized]
    return states, resized


def _saved_rng(path: Path, meta: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """This rank's saved RNG state (None: none saved for it)."""
    rng_ranks = meta.get("rng_ranks")
    if isinstance(rng_ranks, list) and rng_ranks:
        # Every rank's state was saved: each rank takes its own.
        return state_for_rank(rng_ranks, _dist.rank(), max(_dist.world_size(), 1), str(path))
    return next((meta[k] for k in RNG_KEYS if isinstance(meta.get(k), Mapping)), None)


def _holds_rng(meta: Mapping[str, Any]) -> bool:
    rng_ranks = meta.get("rng_ranks")
    return (any(isinstance(meta.get(k), Mapping) for k in RNG_KEYS)
            or (isinstance(rng_ranks, list) and bool(rng_ranks)))
