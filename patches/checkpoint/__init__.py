"""Vocabulary-aware checkpoints: :func:`load_checkpoint` (verified, all or nothing: decide,
then apply with undo) and :class:`CheckpointManager` (atomic saves, manifests, resume).

It imports torch, the standard library and generic sibling modules only, never an
integration. The design: docs/design/checkpoint.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .._options import Option
from .._registry import PatchSpec, Site, register
from ..row_init import DEFAULT_HEAD_ROW_INIT, DEFAULT_ROW_INIT, check_rule, rules_for
from . import data_position
from .errors import (CheckpointError, CheckpointMismatchError, CheckpointWriteError, DiskFullError,
                     UnsafeCheckpointError)

if TYPE_CHECKING:  # the names :func:`__getattr__` loads on first use, for the reader and tools
    from .reading import (CHECKPOINT_SUFFIXES, FORMAT, MANIFEST_SUFFIX, Manifest, check_file,
                          manifest_path, newest_valid_beside, read_checkpoint, read_manifest)
    from .atomic import atomic_torch_save, atomic_write
    from .decide import LoadOptions
    from .load import POLICIES, LoadReport, load_checkpoint, warn_weights_only
    from .report import PARTS, STATUSES, Part
    from .manager import LATEST, CheckpointManager
    from .plan import VOCAB_SUFFIXES
    from .rng import capture_rng_state, restore_rng_state
    from .sharded import DCP_SUFFIX, check_folder

# The loader, the manager and their modules load on the first use of one of their names, not
# at ``import patches.auto`` (half its time, issue 41). Each public name -> its submodule.
_LAZY: dict[str, str] = {name: module for module, names in (
    ("reading", ("CHECKPOINT_SUFFIXES", "FORMAT", "MANIFEST_SUFFIX", "Manifest", "check_file",
                 "manifest_path", "newest_valid_beside", "read_checkpoint", "read_manifest")),
    ("atomic", ("atomic_torch_save", "atomic_write")),
    ("decide", ("LoadOptions",)),
    ("load", ("POLICIES", "LoadReport", "load_checkpoint", "warn_weights_only")),
    ("report", ("PARTS", "STATUSES", "Part")),
    ("manager", ("LATEST", "CheckpointManager")),
    ("plan", ("VOCAB_SUFFIXES",)),
    ("rng", ("capture_rng_state", "restore_rng_state")),
    ("sharded", ("DCP_SUFFIX", "check_folder")),
) for name in names}
# The submodules, which ``patches.checkpoint.<name>`` still reaches without an import.
_SUBMODULES = frozenset((
    "_collective", "atomic", "data_position", "decide", "digest", "ema", "errors", "file_model",
    "grown", "load", "manager", "optimizer", "parts", "plan", "reading", "report", "rng",
    "sharded"))


def __getattr__(name: str) -> Any:
    """A name of :data:`_LAZY` (or a submodule), imported on its first use and kept (PEP 562:
    asked only for a name this module does not hold yet)."""
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, *_SUBMODULES})


# The generic ``checkpoint`` patch: the loader and the manager are its API; the integrations
# bring its other sites.
def _resume_policy(text: Any) -> str:
    from .load import POLICIES  # lazy: the loader loads on first use (see _LAZY)

    value = str(text).strip().lower()
    if value not in POLICIES:
        raise ValueError(f"expected {' or '.join(POLICIES)}")
    return value


def _row_rule(what: str):
    def parse(text: Any) -> str:
        value = str(text).strip().lower()
        try:
            return check_rule(value, what)
        except ValueError:
            raise ValueError(f"expected one of {', '.join(rules_for(what))}") from None
    return parse


SPEC = register(PatchSpec(
    name="checkpoint",
    # every iter() of a DataLoader is watched, so a checkpoint can hold where it stood
    sites=(Site("torch.utils.data.dataloader", "DataLoader.__iter__", data_position.make_iter,
                lost="CheckpointManager.save(loader=) saves no DataLoader position (a WARNING) "
                     "and a resume starts the epoch again"),),
    describe=lambda o: (f"vocabulary-aware restore (policy {o.resume_policy}), atomic saves, "
                        f"continue from the newest valid checkpoint"),
    options=(Option("resume_policy", _resume_policy, "remap",
                    "remap (keep optimizer, scheduler and scaler; grow moments of resized "
                    "rows) or reset (start all three fresh)",
                    "`remap` keeps optimizer, scheduler and scaler on resume (moments resized); "
                    "`reset` starts all three fresh", shown_default="`remap`"),
             Option("row_init", _row_rule("row_init"), DEFAULT_ROW_INIT,
                    " / ".join(rules_for("row_init")),
                    "how the text embedding's new rows start when the vocabulary grows "
                    "(`auto`: `spelling` where the base model reads its text, `std0.02` where "
                    "it does not; `spelling` and `romanized` need the tokenizer; without it "
                    "`spread`; `romanized_offset` is deprecated)",
                    shown_default=f"`{DEFAULT_ROW_INIT}`"),
             Option("head_row_init", _row_rule("head_row_init"), DEFAULT_HEAD_ROW_INIT,
                    " / ".join(rules_for("head_row_init")),
                    "how the text head's new rows (and bias entries) start when the "
                    "vocabulary grows", shown_default=f"`{DEFAULT_HEAD_ROW_INIT}`")),
))

__all__ = ["load_checkpoint", "LoadOptions", "LoadReport", "CheckpointManager", "CheckpointError",
           "UnsafeCheckpointError", "CheckpointMismatchError", "read_checkpoint", "check_file",
           "newest_valid_beside", "atomic_write", "atomic_torch_save", "capture_rng_state",
           "restore_rng_state", "DiskFullError", "CheckpointWriteError", "manifest_path",
           "read_manifest", "Manifest", "check_folder", "DCP_SUFFIX", "warn_weights_only", "Part",
           "PARTS", "STATUSES"]
