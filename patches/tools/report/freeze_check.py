"""Did the frozen base-vocabulary rows stay put? Checked from the files of the run.

A run records its freeze where it starts: headlessXttsTrain.py writes the base model file
and the frozen row ranges into ``headless_runs.jsonl`` (``base_weights``), any coqui
Trainer whose GPTTrainer loaded its base weights (``xtts_checkpoint``, ``gpt_checkpoint``)
into ``trainer_runs.jsonl``. The check
compares those rows of the text embedding and text head in the run's newest checkpoint
with the base model's rows, bit for bit (``max |checkpoint - base|``); relative paths are
resolved from the working directory the run recorded. Without such a record nothing is
claimed; a check that cannot run says why (``checked`` False), and the report names it.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import torch

from ...checkpoint import read_checkpoint
from . import reading
from .reading import Run

VOCAB_TENSORS = ("text_embedding.weight", "text_head.weight", "text_head.bias")


def _start_weights(run: Run) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(record, its ``base_weights``) of every start record of ``run``'s files that has them."""
    for record in [*run.get(reading.HEADLESS), *run.get(reading.TRAINER_RUNS)]:
        weights = record.get("base_weights")
        if record.get("event") == "start" and isinstance(weights, dict):
            yield record, weights


def _freeze_records(run: Run) -> tuple[dict[str, Any] | None, list[str]]:
    """The start record of ``run`` that names a freeze, and the relative run folders of
    freeze records that could not be resolved (neither is this run's, as far as known)."""
    unresolved = []
    for record, weights in _start_weights(run):
        if not (weights.get("frozen_rows") and weights.get("path")):
            continue
        mine = reading.names_run(record, run)
        if mine:
            return record, []
        if mine is None:
            unresolved.append(str(record.get("run_folder")))
    return None, unresolved


def new_rows_of(run: Run) -> dict[str, Any] | None:
    """How the new vocabulary rows of ``run``'s base weights started (``row_init`` of its
    start record's ``base_weights``: the rules, the spelled counts, auto's probe), or None."""
    for record, weights in _start_weights(run):
        if isinstance(weights.get("row_init"), dict) and reading.names_run(record, run):
            return weights["row_init"]
    return None


def describe_new_rows(rows: dict[str, Any]) -> str:
    """``embedding std0.02, head spread (row_init auto: the base model does not read its text,
    text_tv 0.007 at or below 0.05)``: the report's line, from the start record."""
    text = f"embedding {rows.get('embedding')}, head {rows.get('head')}"
    if rows.get("spelled") is not None:
        text += f"; {rows['spelled']} spelled, {rows.get('fallback', 0)} by spread"
    auto = rows.get("auto")
    if isinstance(auto, dict):
        said = ("could not tell whether the base model reads its text" if auto.get("reads") is None
                else "the base model reads its text" if auto.get("reads")
                else "the base model does not read its text")
        text += f" (row_init auto: {said}, {auto.get('why')})"
    return text


def _newest_checkpoint(folder: str) -> str | None:
    paths = [os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".pth")
             and (n.startswith("checkpoint_") or n.startswith("best_model"))]
    return max(paths, key=os.path.getmtime) if paths else None


def _vocab_tensors(path: str) -> dict[str, Any]:
    state = read_checkpoint(path)
    state = state.get("model", state) if isinstance(state, dict) else {}
    # XTTS's model.pth and the coqui Trainer's checkpoints hold gpt.*; a gpt_checkpoint the
    # bare GPT's keys
    return {suffix: value for suffix in VOCAB_TENSORS for key, value in state.items()
            if key == suffix or key.endswith("." + suffix)}


def _not_checked(why: str) -> dict[str, Any]:
    return {"moved": False, "checked": False, "max_drift": None, "detail": f"not checked: {why}"}


def check_frozen_rows(run: Run) -> dict[str, Any] | None:
    """``{"moved", "checked", "max_drift", "detail", ...}``, or None when the run records no
    freeze. ``checked`` is False when the check could not run (no checkpoint, a path that
    cannot be resolved or read, rows that do not match): the report says so."""
    record, unresolved = _freeze_records(run)
    if record is None:
        return None if not unresolved else _not_checked(
            f"headless_runs.jsonl records a freeze for the relative run folder(s) "
            f"{', '.join(unresolved)} and not the working directory they were relative to, so "
            f"it cannot tell whether one of them is {run.folder}")
    weights = record["base_weights"]
    base_path = reading.recorded_path(record, weights["path"], run)
    if base_path is None:
        return _not_checked(f"the base model {weights['path']} is a relative path and "
                            f"headless_runs.jsonl does not record the folder it was relative to")
    checkpoint = _newest_checkpoint(run.folder)
    if checkpoint is None:
        return _not_checked("no checkpoint in the run folder to check the frozen rows against")
    try:
        ranges = [range(int(a), int(b) + 1) for a, b in weights["frozen_rows"]]
        rows = torch.tensor([i for r in ranges for i in r], dtype=torch.long)
        base = _vocab_tensors(base_path)
        trained = _vocab_tensors(checkpoint)
    except Exception as exc:  # noqa: BLE001 - a report states what it could not check
        return _not_checked(f"{type(exc).__name__}: {exc}")
    worst = 0.0
    compared = []
    for name, old in base.items():
        new = trained.get(name)
        if new is None or old.shape[0] != len(rows) or int(rows.max()) >= new.shape[0]:
            continue
        worst = max(worst, float((new.index_select(0, rows).float() - old.float()).abs().max()))
        compared.append(name)
    if not compared:
        return _not_checked(f"the row layout of {base_path} and {checkpoint} does not match "
                            f"the recorded frozen rows {weights['frozen_rows']}")
    return {"moved": worst > 0.0, "checked": True, "max_drift": worst, "checkpoint": checkpoint,
            "detail": f"{len(rows)} rows {weights['frozen_rows']} of {', '.join(compared)}: max "
                      f"|{os.path.basename(checkpoint)} - base| = {worst:.3g}"}
