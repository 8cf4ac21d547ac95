"""Vocabulary-aware checkpoints: load safely, grow the vocabulary, save atomically, resume.

Two public doors:

- :func:`load_checkpoint` reads a checkpoint with ``weights_only=True`` (a file whose
  unpickling would run code is refused before any of it runs), memory-mapped where the
  file allows it, verifies it (the SHA-256 of its manifest, or the zip's CRC-32s),
  validates every tensor before touching anything (present, with data, the planned shape
  and kind of dtype, finite), grows the text vocabulary when the model's tokenizer grew
  (see :mod:`patches.vocab_resize`), refuses every other shape mismatch, and restores the
  optimizer, scheduler and scaler as one matched set under ``policy="remap"`` or starts
  all three fresh under ``policy="reset"``. All or nothing: a refused load leaves the
  model, optimizer, scheduler, scaler and RNG as they were. It returns a
  :class:`LoadReport`.
- :class:`CheckpointManager` checks the free space, writes checkpoints atomically
  (temporary file in the same folder, fsync of the file and the folder, ``os.replace``),
  a small manifest last (size, SHA-256, a generation number, the names of any NaN/Inf
  tensors), a ``latest`` pointer, prunes only the checkpoints it wrote itself, by
  generation, and ``resume("auto")`` finds the most recently written checkpoint whose
  manifest and file validate. A failed save leaves none of its files behind. Under a
  process group every rank calls it: rank 0 writes, all ranks get one outcome
  (:mod:`._collective`); FSDP2 models are saved sharded through DCP (:mod:`.sharded`).

A checkpoint written by :class:`CheckpointManager` is a dict with ``model``,
``optimizer``, ``scheduler``, ``scaler``, ``step``, ``rng`` (torch, CUDA, numpy, python),
``training_patches`` (the runtime counters of :func:`patches._api.runtime_state`) and
``extra`` (whatever the caller passed, e.g. the data position). coqui Trainer checkpoints
(``model``/``optimizer`` lists/``scheduler`` lists/``scaler``/``step``/``epoch``) and bare
state dicts load through the same function.

The package, by concern: :mod:`.errors`, :mod:`._validate` (file checks, manifests, pickle
inspection, diagnosis), :mod:`.plan` (key matching, the vocabulary plan),
:mod:`.optimizer` (moment remap, restart of scheduler and scaler), :mod:`.rng`,
:mod:`.atomic`, :mod:`.manager` and :mod:`.load`. It imports torch, the standard library
and generic sibling modules only, never an integration.
"""

from __future__ import annotations

from .._registry import PatchSpec, register
from .reading import (CHECKPOINT_SUFFIXES, FORMAT, MANIFEST_SUFFIX, Manifest, check_file,
                      manifest_path, newest_valid_beside, read_checkpoint, read_manifest)
from .atomic import atomic_torch_save, atomic_write
from .errors import CheckpointError, CheckpointMismatchError, DiskFullError, UnsafeCheckpointError
from .load import POLICIES, LoadReport, load_checkpoint, warn_weights_only
from .report import PARTS, STATUSES, Part
from .manager import LATEST, CheckpointManager
from .plan import VOCAB_SUFFIXES
from .rng import capture_rng_state, restore_rng_state
from .sharded import DCP_SUFFIX, check_folder

# The generic ``checkpoint`` patch: the loader and the manager above are its API; its sites
# come from the integrations (the coqui Trainer's restore/save/continue, XTTS's
# gpt_checkpoint/xtts_checkpoint).
SPEC = register(PatchSpec(
    name="checkpoint",
    describe=lambda o: (f"vocabulary-aware restore (policy {o.resume_policy}), atomic saves, "
                        f"continue from the newest valid checkpoint"),
))

__all__ = [
    "load_checkpoint", "LoadReport", "CheckpointManager", "CheckpointError",
    "UnsafeCheckpointError", "CheckpointMismatchError", "read_checkpoint", "check_file",
    "newest_valid_beside", "atomic_write", "atomic_torch_save", "capture_rng_state",
    "restore_rng_state", "DiskFullError", "manifest_path", "read_manifest", "Manifest",
    "check_folder", "DCP_SUFFIX", "warn_weights_only", "Part", "PARTS", "STATUSES",
]
