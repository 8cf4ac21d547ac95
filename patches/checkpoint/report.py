""":class:`LoadReport`, what a load did (single-file and sharded loads alike), and the
runtime counters a checkpoint carries."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass
class LoadReport:
    """What :func:`load_checkpoint` did.

    ``step`` is the step to resume at: the checkpoint's step under ``remap``, 0 under
    ``reset``. ``resized`` maps each grown tensor to (old shape, new shape);
    ``kept_rows`` counts the trained rows copied unchanged into each of them.
    """

    path: str
    policy: str
    step: int
    epoch: int | None = None
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
    extra: dict[str, Any] = field(default_factory=dict)
    checkpoint: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def vocab_grew(self) -> bool:
        return bool(self.resized)

    def summary(self) -> str:
        """One paragraph for the log."""
        parts = [f"loaded {self.path} (step {self.step}, policy {self.policy})"]
        if self.resized:
            parts.append(
                f"vocabulary {self.base_vocab_size} -> {self.vocab_size} rows"
                f"{' (truncated on request)' if self.vocab_size < self.base_vocab_size else ''}: "
                + ", ".join(
                    f"{name} {list(old)}->{list(new)} ({self.kept_rows[name]} trained rows kept)"
                    for name, (old, new) in self.resized.items()))
            if self.start_row_moved:
                parts.append("start-text token row moved to the new last row")
        if self.restored:
            parts.append("restored: " + ", ".join(self.restored))
        if self.reset:
            parts.append("fresh: " + ", ".join(self.reset))
        if self.optimizer_moments_resized:
            parts.append(f"optimizer moments resized for {len(self.optimizer_moments_resized)} "
                         "parameter(s) (new rows: first moment 0, second moment = old rows' mean)")
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


def restarted(optimizers: list[Any], schedulers: list[Any], scaler: Any) -> list[str]:
    """The names of the parts a ``reset`` load started fresh (for ``LoadReport.reset``)."""
    return [name for name, objs in (("optimizer", optimizers), ("scheduler", schedulers),
                                    ("scaler", [scaler] if scaler is not None else [])) if objs]
