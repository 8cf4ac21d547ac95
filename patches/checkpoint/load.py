"""``load_checkpoint``, the door of every load: a sharded folder goes to :mod:`.sharded`;
a single file is decided (:mod:`.decide`: read, validate, plan), agreed on by every rank,
applied with undo (:mod:`.apply`), then reported (:class:`LoadReport`, the log lines)."""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .. import _options
from .._log import info
from ..vocab_rows import row_layout
from . import _collective
from . import ema as ema_part
from .apply import apply
from .decide import LoadOptions, LoadPlan, decide
from .errors import CheckpointError
from .parts import and_list, new_report, report_parts, say_fallback
from .plan import ModelPlan
from .report import LoadReport
from .sharded import is_sharded_model, load_sharded

logger = logging.getLogger("training_patches")

POLICIES = ("remap", "reset")


def load_checkpoint(
    path: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    scheduler: Any = None,
    scaler: Any = None,
    options: LoadOptions | None = None,
    **overrides: Any,
) -> LoadReport:
    """Load ``path`` into ``model`` (and the optimizer, scheduler, scaler) safely, all or
    nothing: every tensor is validated before anything is touched, and a refused load leaves
    the model, optimizer, scheduler, scaler and RNG exactly as they were.
    Design: docs/design/checkpoint.md.

    Args:
        path: a checkpoint written by :class:`CheckpointManager`, the coqui Trainer, or
            ``torch.save(model.state_dict())``; or the folder of a sharded (FSDP2) save,
            loaded through ``torch.distributed.checkpoint`` into any number of ranks.
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
        collective: agree with the other ranks: call it from EVERY rank of the process
            group; no rank changes its model unless every rank passed, and a refusal on one
            is raised on all. None: when a process group of more than one rank is up.
            False: this process alone (a call on some ranks only).
        resume_step: False for a weights-only start that counts from step 0 (coqui's
            ``restore_path``, XTTS's ``xtts_checkpoint``): ``report.step`` is 0 and the
            report says the saved step was dropped; :func:`warn_weights_only` then names
            what the file held that the start lost.
        row_init, head_row_init: how the new rows of the text embedding and of the text
            head start when the vocabulary grew (:mod:`patches.row_init`:
            ``romanized_offset``, ``romanized``, ``spread``, ``mean``, ``std0.02``,
            ``randn``); default ``TRAINING_PATCHES_ROW_INIT`` /
            ``TRAINING_PATCHES_HEAD_ROW_INIT``.
        tokenizer: the grown tokenizer the model was built with (a ``vocab.json``, a
            SentencePiece ``.model``, or such an object), which the spelled rules need to
            spell the new tokens; without it their rows start by ``spread`` (the report says so).
        ema: the EMA of the model (ema_pytorch's ``EMA``, torch's ``AveragedModel``, or the
            averaged copy): the file's EMA weights (``CheckpointManager.save(..., ema=)``) are
            loaded into it, vocabulary-aware: its trained rows kept, its new rows started as
            the model's, and with the freeze its base rows kept bit-identical through its
            updates (:mod:`patches.checkpoint.ema`). The report's ``ema`` part says what
            was done.
        loader: the DataLoader the training loop iterates (or a loader with its own
            ``state_dict``, such as torchdata's ``StatefulDataLoader``): its next ``iter()``
            continues the saved epoch at the saved batch, with the same order, so the
            resumed run sees the batches the stopped one would have seen next
            (:mod:`patches.checkpoint.data_position`; saved by ``CheckpointManager.save(...,
            loader=)``). The report's ``data`` part says what was done.

    Every option above is a field of :class:`LoadOptions`: pass ``options=LoadOptions(...)``,
    keywords, or both (a keyword wins). An unknown keyword is a TypeError naming the
    closest option. A sharded checkpoint folder honours only ``policy``, ``restore_rng``,
    ``verify_hash``, ``allow_nonfinite`` and ``loader``, and loads on every rank together (so
    ``collective=False`` cannot apply): any other option set for one is refused (ValueError,
    nothing loaded), never dropped.

    Returns:
        A :class:`LoadReport`: ``parts`` says what happened to each part (model, optimizer,
        scheduler, scaler, step, rng: restored / remapped / reset / dropped / absent); the
        log lines are read from it.

    Raises:
        UnsafeCheckpointError, CheckpointError, CheckpointMismatchError: before anything
        was changed (CheckpointError too for a single file into an FSDP2 model: load it
        before sharding).
    """
    options = _options_of(options, overrides)
    if options.policy not in POLICIES:
        raise ValueError(f"load_checkpoint: policy must be one of {POLICIES}, got "
                         f"{options.policy!r}")
    path = Path(path)
    if path.is_dir():
        _refuse_for_folder(path, options)
        return load_sharded(path, model, optimizer, scheduler, scaler, policy=options.policy,
                            restore_rng=options.restore_rng, verify_hash=options.verify_hash,
                            allow_nonfinite=options.allow_nonfinite, loader=options.loader)
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
    options = options.resolved()  # a bad row rule is refused before any rank reads the file
    collective = options.collective
    if collective is False or not _collective.active():
        return _load_file(path, model, optimizer, scheduler, scaler, options, gate=None)
    return _collective.on_every_rank(
        lambda gate: _load_file(path, model, optimizer, scheduler, scaler, options, gate=gate))


def _options_of(options: LoadOptions | None, overrides: dict[str, Any]) -> LoadOptions:
    """``options`` (default: :class:`LoadOptions`'s defaults) with ``overrides`` applied; an
    unknown keyword is one paragraph naming the closest field."""
    if options is not None and not isinstance(options, LoadOptions):
        raise TypeError(f"load_checkpoint: options is a {type(options).__name__}; expected a "
                        f"patches.LoadOptions (or leave it out and pass keywords).")
    fields = [f.name for f in dataclasses.fields(LoadOptions)]
    unknown = [name for name in overrides if name not in fields]
    if unknown:
        near = [difflib.get_close_matches(name, fields, n=1) for name in unknown]
        said = ", ".join(f"{name!r}" + (f" (did you mean {m[0]!r}?)" if m else "")
                         for name, m in zip(unknown, near))
        raise TypeError(f"load_checkpoint got the unknown option(s) {said}. Expected the "
                        f"fields of patches.LoadOptions: {', '.join(fields)}.")
    return dataclasses.replace(options or LoadOptions(), **overrides)


def _refuse_for_folder(path: Path, options: LoadOptions) -> None:
    """A sharded folder loads the saved shapes into the same sharded model: the options of
    a single file (vocabulary growth, key filters, pickles, step dropping) cannot apply."""
    defaults = LoadOptions()
    unusable = [f"{f.name}={getattr(options, f.name)!r}" for f in dataclasses.fields(options)
                if f.name not in LoadOptions.FOLDER_FIELDS
                and getattr(options, f.name) != getattr(defaults, f.name)
                and not (f.name == "collective" and options.collective)]
    if unusable:
        raise ValueError(
            f"load_checkpoint: {path} is a sharded checkpoint folder (torch.distributed."
            f"checkpoint), which loads the tensors as saved into the same sharded model; the "
            f"option(s) {', '.join(unusable)} apply to a single checkpoint file and cannot be "
            f"honoured here. Nothing was loaded. Leave them out for a folder (it honours "
            f"{', '.join(LoadOptions.FOLDER_FIELDS)}, and loads on every rank together), or "
            f"load a single-file checkpoint.")


def _load_file(path: Path, model: torch.nn.Module, optimizer: Any, scheduler: Any,
               scaler: Any, options: LoadOptions, *,
               gate: Callable[[], None] | None) -> LoadReport:
    """:func:`load_checkpoint` of one file on this rank: decide (nothing changes), then
    ``gate()`` (every rank together: a refusal on any rank stops all of them there), then
    apply with undo, then the report and its log lines."""
    plan = decide(path, model, optimizer, scheduler, scaler, options)
    if gate is not None:
        gate()
    report = new_report(plan.state, checkpoint=plan.checkpoint)
    missing = apply(plan, model, report)
    _report_model(report, plan, missing, resume_step=options.resume_step)
    rows = plan.model.rows
    if rows is not None and rows.added > 0 and options.freeze:
        report.freeze = _enable_freeze(model, plan.model, options.vocab_modules)
        if plan.ema is not None and plan.ema.rows is not None and report.freeze is not None:
            # the rows the model's freeze keeps, kept in the EMA too
            report.ema_freeze = ema_part.KeptRows(plan.state.ema, plan.ema.resized,
                                                  report.freeze.rows)
            info("training-patches: EMA weights: %s", report.ema_freeze.describe())
    _model_part(report, plan.model)
    report_parts(report, plan.state, resume_step=options.resume_step)
    _say(path, report, plan.model)
    say_fallback(report, plan.state)
    return report


def _report_model(report: LoadReport, plan: LoadPlan, missing: list[str], *,
                  resume_step: bool) -> None:
    """The report's fields about the model and the policy, read from the plan applied."""
    model = plan.model
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
    if not resume_step:
        report.step = 0
    if model.prefix_stripped or model.prefix_added:
        report.prefix_stripped, report.prefix_added = model.prefix_stripped, model.prefix_added
        report.renamed_keys = len(model.aligned)  # every matched key went through the prefix
    report.dtype_casts = dict(model.casts)


def _model_part(report: LoadReport, plan: ModelPlan) -> None:
    """``report.parts["model"]`` of a single file (the other parts: :func:`.parts.report_parts`)."""
    if plan.rows is not None:
        rows = plan.rows
        how = f" ({plan.new_rows.describe()})" if plan.new_rows is not None else ""
        change = (f"grown by {rows.added} vocabulary row(s){how}"
                  if rows.added >= 0 else
                  f"cut by their last {-rows.added} vocabulary row(s) (truncate=True)")
        report.set_part("model", "remapped", f"{len(plan.state)} tensor(s), "
                        f"{len(plan.resized)} of them {change}", in_file=True)
    else:
        report.set_part("model", "restored", f"{len(plan.state)} tensor(s)", in_file=True)


def _say(path: Path, report: LoadReport, plan: ModelPlan) -> None:
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
                   report.path, and_list(held), why, hint)
    return True


def _enable_freeze(model: torch.nn.Module, plan: ModelPlan, vocab_modules: Sequence[str]) -> Any:
    """Freeze the base rows of the grown vocabulary (vocab_freeze may be absent)."""
    try:
        # Imported at the top, vocab_freeze would register its patch before checkpoint's
        # (the banner's order is the registration order, patches/__init__.py).
        from .. import vocab_freeze  # lazy: import order; and optional (ImportError below)
    except ImportError:
        logger.warning(
            "training-patches: the vocabulary grew from %d to %d rows but patches.vocab_freeze is "
            "not available, so the base rows are not frozen.", plan.rows.old_rows, plan.rows.new_rows)
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
