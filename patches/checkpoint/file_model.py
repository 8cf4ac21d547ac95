"""The model part of a single checkpoint file (:class:`FileModel`, the file's
:class:`~.parts.ModelSource`): planned from the file's whole tensors (keys matched, shapes
and dtypes checked, vocabulary rows grown, NaN/Inf refused: :mod:`.plan`), loaded, then,
after a growth, the base rows frozen in the model and in the EMA; reported as restored or
remapped. A sharded folder's model part is :class:`.sharded.ShardedModel`."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from .. import _options
from .._log import info
from ..vocab_rows import row_layout
from . import ema as ema_part
from .parts import ModelSource, StatePlan
from .plan import ModelPlan, check_finite, plan_model
from .report import LoadReport

logger = logging.getLogger("training_patches")


class FileModel(ModelSource):
    """The model's tensors of the checkpoint ``ckpt`` (read from ``path``), into ``model``,
    as ``options`` (a :class:`.decide.LoadOptions`, resolved) say."""

    def __init__(self, path: Path, ckpt: Mapping[str, Any], model: torch.nn.Module,
                 options: Any) -> None:
        self.path, self.ckpt, self.model, self.options = path, ckpt, model, options

    def plan(self, plan: StatePlan) -> ModelPlan:
        return plan_tensors(self.path, self.ckpt, self.model, self.options,
                            key_filter=self.options.key_filter)

    def apply(self, plan: StatePlan, report: LoadReport, undo: list[Callable[[], None]]) -> None:
        model_plan: ModelPlan = plan.model_plan
        # Everything torch could refuse was checked when it was planned.
        missing, _ = self.model.load_state_dict(model_plan.state, strict=False)
        _report_model(report, model_plan, missing)
        rows = model_plan.rows
        if rows is not None and rows.added > 0 and self.options.freeze:
            report.freeze = _enable_freeze(self.model, model_plan, self.options.vocab_modules)
            ema_plan = plan.ema_plan
            if ema_plan is not None and ema_plan.rows is not None and report.freeze is not None:
                # the rows the model's freeze keeps, kept in the EMA too
                report.ema_freeze = ema_part.KeptRows(plan.ema, ema_plan.resized,
                                                      report.freeze.rows)
                info("training-patches: EMA weights: %s", report.ema_freeze.describe())

    def report(self, plan: StatePlan, report: LoadReport) -> None:
        model_plan: ModelPlan = plan.model_plan
        if model_plan.rows is not None:
            rows = model_plan.rows
            how = f" ({model_plan.new_rows.describe()})" if model_plan.new_rows is not None else ""
            sources = model_plan.new_rows.sources if model_plan.new_rows is not None else None
            for line in sources.warnings() if sources is not None else ():
                logger.warning("%s", line)  # a romaniser that failed on most tokens
            change = (f"grown by {rows.added} vocabulary row(s){how}"
                      if rows.added >= 0 else
                      f"cut by their last {-rows.added} vocabulary row(s) (truncate=True)")
            report.set_part("model", "remapped", f"{len(model_plan.state)} tensor(s), "
                            f"{len(model_plan.resized)} of them {change}", in_file=True)
        else:
            report.set_part("model", "restored", f"{len(model_plan.state)} tensor(s)",
                            in_file=True)


def plan_tensors(path: Path, ckpt: Mapping[str, Any], module: torch.nn.Module, options: Any, *,
                 key_filter: Callable[[str], bool] | None = None) -> ModelPlan:
    """:func:`.plan.plan_model` of ``ckpt`` into ``module`` with the load's ``options``, then
    NaN/Inf refused unless ``allow_nonfinite``: the model's plan, and the EMA weights'."""
    planned = plan_model(path, ckpt, module, strict=options.strict,
                         vocab_modules=options.vocab_modules,
                         start_token_row=options.start_token_row, seed=options.seed,
                         key_filter=key_filter, truncate=options.truncate,
                         row_init=options.row_init, head_row_init=options.head_row_init,
                         tokenizer=options.tokenizer)
    if not options.allow_nonfinite:
        check_finite(path, planned, module)
    return planned


def _report_model(report: LoadReport, model: ModelPlan, missing: list[str]) -> None:
    """The report's fields about the model, read from the plan applied."""
    report.missing_keys = sorted(set(missing) | set(model.missing))
    report.unexpected_keys = list(model.unexpected)
    report.loaded.append("model")
    if model.rows is not None:
        report.resized = dict(model.resized)
        report.kept_rows = {key: min(model.rows.old_rows, model.rows.new_rows)
                            for key in model.resized}
        report.base_vocab_size, report.vocab_size = model.rows.old_rows, model.rows.new_rows
        report.start_row_moved = model.rows.start_row_last
        report.new_rows = model.new_rows
    if model.prefix_stripped or model.prefix_added:
        report.prefix_stripped, report.prefix_added = model.prefix_stripped, model.prefix_added
        report.renamed_keys = len(model.aligned)  # every matched key went through the prefix
    report.dtype_casts = dict(model.casts)


def _enable_freeze(model: torch.nn.Module, plan: ModelPlan, vocab_modules: Sequence[str]) -> Any:
    """Freeze the base rows of the grown vocabulary (vocab_freeze may be absent)."""
    try:
        # Imported at the top, vocab_freeze would register its patch before checkpoint's
        # (the banner's order is the registration order, patches/__init__.py).
        from .. import vocab_freeze  # lazy: import order; and optional (ImportError below)
    except ImportError:
        logger.warning(
            "training-patches: the vocabulary grew from %d to %d rows but patches.vocab_freeze is "
            "not available, so the base rows are not frozen.",
            plan.rows.old_rows, plan.rows.new_rows)
        return None
    modules = sorted({key.rsplit(".", 1)[0] for key in plan.resized})
    base_rows = _base_rows(model, plan, modules)
    return vocab_freeze.freeze_base_vocab(model, base_rows, modules=modules,
                                          start_row_last=plan.rows.start_row_last)


def _base_rows(model: torch.nn.Module, plan: ModelPlan, modules: Sequence[str]) -> int:
    """Rows of the BASE vocabulary to freeze after a growth: not every row of the checkpoint
    (rows already trained for the new language keep training), but the first
    ``TRAINING_PATCHES_BASE_VOCAB`` tokens (in the model's row layout), else the base of a
    freeze already on these modules, else, when neither is known, every old row (logged)."""
    from .. import vocab_freeze  # lazy: import order (see _enable_freeze, which imported it)

    old_rows = plan.rows.old_rows
    owner_path = modules[0].rsplit(".", 1)[0] if "." in modules[0] else ""
    owner = model.get_submodule(owner_path) if owner_path else model
    tokens = _options.current().base_vocab
    if tokens:
        rows = row_layout(owner, plan.rows.new_rows).base_rows(tokens)
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


__all__ = ["FileModel", "plan_tensors"]
