"""``dataset_guard``: samples a dataset cannot load are dropped visibly, never in silence.

The generic half of the dataset guard: where dropped samples are listed
(``dropped_samples.jsonl`` in the run's output folder, :func:`patches._run.output_dir`,
else the working directory; ``dropped_samples.rank<R>.jsonl`` for rank R of a job of
several ranks), how each is recorded once (the DataLoader workers of one rank append to
its file under a lock; ranks never share one), and the error that stops a run when more than
``max_drop_share`` of the samples fail. An integration (XTTS: :mod:`patches.integrations.
xtts_dataset`) decides what a bad sample is and calls :func:`record_drop`.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from . import _run
from ._log import info, logger
from ._options import Option, share
from ._registry import PatchSpec, register

REPORT_NAME = _run.DROPPED_FILE


class DatasetUnusableError(RuntimeError):
    """More than ``max_drop_share`` of a dataset's samples cannot be loaded."""


# -- the report ---------------------------------------------------------------

_lock = threading.Lock()


def report_path() -> Path:
    """Where this rank's dropped samples are listed now (see the module doc)."""
    return Path(_run.report_dir()) / _run.rank_file_name(REPORT_NAME)


def sample_key(split: str, sample: dict[str, Any]) -> str:
    return json.dumps([split, str(sample.get("audio_file")), str(sample.get("text")),
                       str(sample.get("language"))], ensure_ascii=False)


def record_drop(path: Path, key: str, entry: dict[str, Any]) -> bool:
    """Append one dropped sample to the report unless ``key`` is already there (DataLoader
    workers share the file: the check and the write happen under one file lock).

    Best effort (:func:`patches._run.append_line`): a report that cannot be read or
    written never stops the dataset; the entry waits in memory and is counted as new."""
    def listed() -> bool:
        try:
            with open(path, encoding="utf-8") as handle:
                return any(_key_of(line) == key for line in handle)
        except OSError:
            return False  # unreadable now: the write says why, once
    with _lock:
        line = _run.json_line(_run.with_rank({**entry, "key": key}))
        return _run.append_line(str(path), line, shared=True, skip=listed)


def _key_of(line: str) -> Any:
    try:
        return json.loads(line).get("key")
    except (ValueError, AttributeError):
        return None


def read_report(path: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """The entries of a ``dropped_samples.jsonl`` (this rank's current one by default)."""
    path = Path(path) if path is not None else report_path()
    if not path.exists():
        return []
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def summary(path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Counts by split and reason of a report: ``{"total": n, "train": {...}, ...}``."""
    entries = read_report(path)
    result: dict[str, Any] = {"total": len(entries), "report": str(path or report_path())}
    for entry in entries:
        split = result.setdefault(entry.get("split", "train"), {})
        split[entry["reason"]] = split.get(entry["reason"], 0) + 1
    return result


def log_summary(path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Log one line with what :func:`summary` returns, and return it."""
    result = summary(path)
    if result["total"] == 0:
        info("training-patches: no samples dropped")
        return result
    parts = []
    for split in ("train", "eval"):
        if split in result:
            reasons = ", ".join(f"{r} {n}" for r, n in sorted(result[split].items()))
            parts.append(f"{split}: {reasons}")
    logger.warning("training-patches: %d samples dropped (%s); each is listed with its "
                   "reason in %s", result["total"], "; ".join(parts), result["report"])
    return result


def _describe(options: Any) -> str:
    return (f"dropped samples listed in {REPORT_NAME}; stop when more than "
            f"{100 * options.max_drop_share:.0f}% of a dataset fails")


SPEC = register(PatchSpec(
    name="dataset_guard", describe=_describe,
    options=(Option("max_drop_share", share, 0.5,
                    "a fraction above 0 and at most 1, e.g. 0.5 (stop when more than half the "
                    "samples cannot be loaded)",
                    "stop when more than this share of samples cannot be loaded",
                    low=0, high=1, low_open=True, bound_why="a share of the samples"),),
))
