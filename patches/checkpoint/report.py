""":class:`LoadReport`, what a load did (single-file and sharded loads alike), and the
runtime counters a checkpoint carries."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..row_init import SPELLED_RULES

# The parts of a checkpoint a load reports on, in the order of the log line.
PARTS = ("model", "ema", "optimizer", "scheduler", "scaler", "step", "rng", "data")
# restored: the file's state is in the object as saved. remapped: it is, adapted to the
# grown (or truncated) vocabulary. reset: the loader started the object (or the step) fresh.
# dropped: the file holds it, and it was not used (nothing received it, or the caller asked
# not to). absent: the file does not hold it (an object passed is left as it was).
STATUSES = ("restored", "remapped", "reset", "dropped", "absent")
_SHOWN = {"rng": "RNG", "data": "data position", "ema": "EMA"}


@dataclass(frozen=True)
class Part:
    """The fate of one part of a checkpoint: a status of :data:`STATUSES` and why."""

    status: str
    detail: str = ""
    in_file: bool = False  # the file holds this part (a "reset" or "dropped" lost it)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"Part.status must be one of {STATUSES}, got {self.status!r}")

    def __str__(self) -> str:
        return f"{self.status} ({self.detail})" if self.detail else self.status


@dataclass
class LoadReport:
    """What :func:`load_checkpoint` did.

    ``step`` is the step to resume at (the checkpoint's under ``remap``, 0 under ``reset``);
    ``saved_step`` the step the file holds (None: none). ``epoch`` is the epoch the file
    holds; ``resume_epoch`` the one a loop continues at (the next one when the saved
    position had ended its epoch; 0 for a weights-only start). ``resized`` maps each grown
    tensor to (old shape, new shape); ``kept_rows`` counts its trained rows kept.

    ``parts`` says, for each of :data:`PARTS`, what happened to it as a :class:`Part`
    (``report.parts["optimizer"].status``); the log line is built from it.
    ``prefix_stripped``/``prefix_added`` and ``renamed_keys``: the key prefix removed from
    (or added to) that many of the file's keys to match the model. ``dtype_casts`` maps each
    model key whose saved dtype was cast to (saved dtype, model dtype). ``new_rows`` (a
    ``checkpoint.plan.NewRows``, None when no row was added) says how the new rows started
    (``row_init`` gives it as a dict).
    """

    path: str
    policy: str
    step: int
    epoch: int | None = None
    resume_epoch: int = 0
    resized: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    kept_rows: dict[str, int] = field(default_factory=dict)
    base_vocab_size: int | None = None
    vocab_size: int | None = None
    start_row_moved: bool = False
    loaded: list[str] = field(default_factory=list)
    restored: list[str] = field(default_factory=list)
    reset: list[str] = field(default_factory=list)
    optimizer_moments_resized: list[str] = field(default_factory=list)
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    rng_restored: bool = False
    runtime_state_restored: bool = False
    freeze: Any = None
    ema_freeze: Any = None  # the EMA's base rows kept (checkpoint.ema.KeptRows)
    extra: dict[str, Any] = field(default_factory=dict)
    checkpoint: dict[str, Any] = field(default_factory=dict, repr=False)
    parts: dict[str, Part] = field(default_factory=dict)
    saved_step: int | None = None
    prefix_stripped: str = ""
    prefix_added: str = ""
    renamed_keys: int = 0
    dtype_casts: dict[str, tuple[str, str]] = field(default_factory=dict)
    new_rows: Any = None

    @property
    def vocab_grew(self) -> bool:
        return bool(self.resized)

    @property
    def row_init(self) -> dict[str, Any] | None:
        """How the new rows started, as data: ``{"embedding": rule, "head": rule,
        "spelled": n, "fallback": n, "fallback_tokens": [...]}`` (the counts only for a
        spelled rule given a tokenizer; ``"tags_from_start": [...]``, the language tags started
        as the start token; ``"auto"``: under row_init auto, the reading probe's answer that
        chose the embedding's rule); None when no row was added."""
        rows = self.new_rows
        if rows is None:
            return None
        out: dict[str, Any] = {"embedding": rows.embedding, "head": rows.head}
        if rows.sources is not None:
            fallback = rows.sources.fallback_tokens(tags_from_start=bool(rows.tag_rows))
            out.update(spelled=len(rows.sources.sources), fallback=len(fallback),
                       fallback_tokens=fallback)
            if rows.tag_rows:
                out["tags_from_start"] = [rows.sources.tags[r] for r in rows.tag_rows]
        elif {rows.embedding, rows.head} & set(SPELLED_RULES):
            out.update(spelled=0, fallback=rows.added, fallback_tokens=[], no_tokenizer=True)
        if rows.reading is not None:  # row_init auto: what chose the embedding's rule
            out["auto"] = rows.reading.as_dict()
        return out

    def as_record(self) -> dict[str, Any]:
        """The load as a run records it where it starts (``base_weights`` of
        headless_runs.jsonl and trainer_runs.jsonl): the file (absolute), the vocabulary's
        growth and the frozen row ranges, which ``report`` checks the run's checkpoints
        against, and how the new rows started (:attr:`row_init`), which it says."""
        freeze = self.freeze
        return {"path": os.path.abspath(self.path), "policy": self.policy,
                "base_vocab_size": self.base_vocab_size, "vocab_size": self.vocab_size,
                "resized": {k: [list(old), list(new)] for k, (old, new) in self.resized.items()},
                "kept_rows": dict(self.kept_rows), "start_row_moved": self.start_row_moved,
                "frozen_rows": ([[r.start, r.stop - 1] for r in freeze.rows]
                                if freeze is not None else None),
                "row_init": self.row_init}

    def set_part(self, name: str, status: str, detail: str = "", *,
                 in_file: bool = False) -> None:
        """Record what happened to the part ``name`` (one of :data:`PARTS`)."""
        if name not in PARTS:
            raise ValueError(f"LoadReport part must be one of {PARTS}, got {name!r}")
        self.parts[name] = Part(status, detail, in_file)

    def not_restored(self) -> list[str]:
        """The parts the file holds that this load did not use (``reset`` or ``dropped``)."""
        return [name for name, part in self.parts.items()
                if part.in_file and part.status in ("reset", "dropped")]

    def parts_line(self) -> str:
        """``model restored (...), optimizer reset (...), ...``: every part in order."""
        shown = []
        for name in PARTS:
            part = self.parts.get(name)
            if part is not None:
                label = _SHOWN.get(name, name)
                if name == "step" and part.status == "restored":
                    label = f"step {self.step}"
                shown.append(f"{label} {part}")
        return ", ".join(shown)

    def summary(self) -> str:
        """One paragraph for the log, built from ``parts`` and the fields above."""
        head = f"loaded {self.path} (policy {self.policy})"
        parts = [f"{head}: {self.parts_line()}" if self.parts else head]
        if self.resized:
            parts.append(
                f"vocabulary {self.base_vocab_size} -> {self.vocab_size} rows"
                f"{' (truncated on request)' if self.vocab_size < self.base_vocab_size else ''}: "
                + ", ".join(
                    f"{name} {list(old)}->{list(new)} ({self.kept_rows[name]} trained rows kept)"
                    for name, (old, new) in self.resized.items()))
            if self.new_rows is not None and not self.parts:
                parts.append(f"new rows: {self.new_rows.describe()}")
            if self.start_row_moved:
                parts.append("start-text token row moved to the new last row")
        if not self.parts:  # a report built by hand, without parts: the plain lists
            if self.restored:
                parts.append("restored: " + ", ".join(self.restored))
            if self.reset:
                parts.append("fresh: " + ", ".join(self.reset))
        if self.optimizer_moments_resized and "optimizer" not in self.parts:
            parts.append(f"optimizer moments resized for {len(self.optimizer_moments_resized)} "
                         "parameter(s) (new rows: first moment 0, second moment = old rows' mean)")
        if self.runtime_state_restored:
            parts.append("runtime counters restored")
        if self.missing_keys or self.unexpected_keys:
            parts.append(f"not in checkpoint: {len(self.missing_keys)} key(s); "
                         f"not in model: {len(self.unexpected_keys)} key(s) (strict=False)")
        return "; ".join(parts)


def _runtime_state(ours: Any) -> dict[str, dict[str, float]] | None:
    """The saved runtime counters when they have the shape ``runtime_state()`` writes."""
    runtime = ours.get("runtime") if isinstance(ours, Mapping) else None
    if not isinstance(runtime, Mapping):
        return None
    for part in runtime.values():
        if not isinstance(part, Mapping) or not all(
                isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
                for k, v in part.items()):
            return None
    return {str(k): dict(v) for k, v in runtime.items()}

