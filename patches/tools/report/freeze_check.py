"""Did the frozen base-vocabulary rows stay put? Checked from the files of the run.

A run records its freeze where it starts: headlessXttsTrain.py writes the base model file
and the frozen row ranges into ``headless_runs.jsonl`` (``base_weights``). The check
compares those rows of the text embedding and text head in the run's newest checkpoint
with the base model's rows, bit for bit (``max |checkpoint - base|``). Without such a
record, or without a checkpoint, nothing is claimed.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ...checkpoint import read_checkpoint
from . import reading
from .reading import Run

VOCAB_TENSORS = ("gpt.text_embedding.weight", "gpt.text_head.weight", "gpt.text_head.bias")


def _freeze_record(run: Run) -> dict[str, Any] | None:
    for record in run.get(reading.HEADLESS):
        if record.get("event") != "start" or record.get("run_folder") not in (None, run.folder):
            continue
        weights = record.get("base_weights")
        if isinstance(weights, dict) and weights.get("frozen_rows") and weights.get("path"):
            return weights
    return None


def _newest_checkpoint(folder: str) -> str | None:
    paths = [os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".pth")
             and (n.startswith("checkpoint_") or n.startswith("best_model"))]
    return max(paths, key=os.path.getmtime) if paths else None


def _vocab_tensors(path: str) -> dict[str, Any]:
    state = read_checkpoint(path)
    state = state.get("model", state) if isinstance(state, dict) else {}
    return {suffix: value for suffix in VOCAB_TENSORS for key, value in state.items()
            if key.endswith(suffix)}


def check_frozen_rows(run: Run) -> dict[str, Any] | None:
    """``{"moved", "max_drift", "detail", ...}``, or None when the run records no freeze."""
    record = _freeze_record(run)
    if record is None:
        return None
    checkpoint = _newest_checkpoint(run.folder)
    if checkpoint is None:
        return {"moved": False, "max_drift": None, "detail": "no checkpoint in the run folder "
                "to check the frozen rows against"}
    ranges = [range(int(a), int(b) + 1) for a, b in record["frozen_rows"]]
    rows = torch.tensor([i for r in ranges for i in r], dtype=torch.long)
    try:
        base = _vocab_tensors(str(record["path"]))
        trained = _vocab_tensors(checkpoint)
    except Exception as exc:  # noqa: BLE001 - a report states what it could not check
        return {"moved": False, "max_drift": None,
                "detail": f"not checked: {type(exc).__name__}: {exc}"}
    worst = 0.0
    compared = []
    for name, old in base.items():
        new = trained.get(name)
        if new is None or old.shape[0] != len(rows) or int(rows.max()) >= new.shape[0]:
            continue
        worst = max(worst, float((new.index_select(0, rows).float() - old.float()).abs().max()))
        compared.append(name.split(".", 1)[1])
    if not compared:
        return {"moved": False, "max_drift": None, "detail": (
            f"not checked: the row layout of {record['path']} and {checkpoint} does not match "
            f"the recorded frozen rows {record['frozen_rows']}")}
    return {"moved": worst > 0.0, "max_drift": worst, "checkpoint": checkpoint,
            "detail": f"{len(rows)} rows {record['frozen_rows']} of {', '.join(compared)}: max "
                      f"|{os.path.basename(checkpoint)} - base| = {worst:.3g}"}
