"""``load_checkpoint``, the door of every load: its options (:class:`LoadOptions`, any a
source cannot honour refused), then a sharded folder goes to :mod:`.sharded`, a single file
to :mod:`.decide` (read, validate, plan every part); both are carried out by
:func:`.parts.carry_out` (every rank agreed, every part applied with undo, the model last,
then reported: :class:`LoadReport` and the log lines)."""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .._log import info
from . import _collective
from .decide import LoadOptions, decide
from .errors import CheckpointError
from .parts import and_list, carry_out
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
        verify_hash: with a manifest beside the file, check its digest (each chunk's
            BLAKE3, or an older manifest's SHA-256; the size is always checked), in threads
            beside ``torch.load``. False skips the hash and logs that it did.
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
            head start when the vocabulary grew (:mod:`patches.row_init`); default
            ``TRAINING_PATCHES_ROW_INIT`` / ``TRAINING_PATCHES_HEAD_ROW_INIT``.
        tokenizer: the grown tokenizer the model was built with (a ``vocab.json``, a
            SentencePiece ``.model``, or such an object), which the spelled rules need;
            without it their rows start by ``spread``. One that does not fit the model's rows
            is a CheckpointMismatchError.
        ema: the EMA of the model (ema_pytorch's ``EMA``, torch's ``AveragedModel``, or the
            averaged copy): the file's EMA weights are loaded into it, vocabulary-aware
            (:mod:`patches.checkpoint.ema`; the report's ``ema`` part).
        loader: the DataLoader the training loop iterates (or a loader with its own
            ``state_dict``): its next ``iter()`` continues the saved epoch at the saved batch
            (:mod:`patches.checkpoint.data_position`; the report's ``data`` part).

    Every option above is a field of :class:`LoadOptions`: pass ``options=LoadOptions(...)``,
    keywords, or both (a keyword wins; an unknown one is a TypeError). A sharded checkpoint
    folder honours only :data:`LoadOptions.FOLDER_FIELDS` and loads on every rank together:
    any other option set for one is refused (ValueError, nothing loaded).

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
                        f"patches.advanced.LoadOptions (or leave it out and pass keywords).")
    fields = [f.name for f in dataclasses.fields(LoadOptions)]
    unknown = [name for name in overrides if name not in fields]
    if unknown:
        near = [difflib.get_close_matches(name, fields, n=1) for name in unknown]
        said = ", ".join(f"{name!r}" + (f" (did you mean {m[0]!r}?)" if m else "")
                         for name, m in zip(unknown, near))
        raise TypeError(f"load_checkpoint got the unknown option(s) {said}. Expected the "
                        f"fields of patches.advanced.LoadOptions: {', '.join(fields)}.")
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
               gate: Callable[..., None] | None) -> LoadReport:
    """:func:`load_checkpoint` of one file on this rank: decide (nothing changes), then
    :func:`.parts.carry_out` (the ranks' gate, every part applied with undo and reported),
    then the log lines."""
    plan = decide(path, model, optimizer, scheduler, scaler, options)
    rows = plan.model.new_rows
    # row_init auto probed on each rank: every rank must have chosen the same rows
    agree = None if rows is None or rows.reading is None else (
        rows.embedding, f"embedding {rows.embedding} ({rows.reading.why})",
        "Choose the new rows' rule for every rank: TRAINING_PATCHES_ROW_INIT=spelling or "
        "std0.02 (docs/design/row_init.md).")
    return carry_out(plan.state, (lambda: gate(agree=agree)) if gate else (lambda: None),
                     lambda report: _say(path, report, plan.model), checkpoint=plan.checkpoint)


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
