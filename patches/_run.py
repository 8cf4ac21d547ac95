"""What the patches know about the run they are in: where it writes, which batch is in hand.

Integrations fill this in (the coqui Trainer's ``output_path``, the batch's audio
paths); a plain loop can call :func:`set_output_dir`, or set
``TRAINING_PATCHES_OUTPUT_DIR``. Files the patches write (``nonfinite_events.jsonl``,
``dropped_samples.jsonl``) go to :func:`output_dir`.

In a job of several ranks every process writes its own files: rank 1's events go to
``nonfinite_events.rank1.jsonl`` (:func:`rank_file_name`), never into a file another
process appends to, and every record says which ``rank`` of how many (``world_size``)
wrote it, and which run (``run_id``: :func:`run_id`). Records are strict JSON: a non-finite float is the string ``"NaN"``,
``"Infinity"`` or ``"-Infinity"`` (:func:`json_line`), which any JSON parser reads.
"""

from __future__ import annotations

import gc
import json
import math
import os
import socket
import threading
import time
from typing import Any, Callable, Iterator

import torch

from . import _dist, _options

_lock = threading.Lock()
_output_dir: str | None = None
_trainer_dir: str | None = None
_checkpoint_dir: str | None = None
# Where reports go when no run folder is known at all (a plain loop before its first save).
DEFAULT_DIR = "training_patches"
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".tar", ".safetensors")
batch_ids: list[str] = []  # sample identifiers of the batch being trained on
trainer_step: int | None = None  # the trainer's own step counter, when an integration knows it

# Names of the files the patches write into a run's folder (kept by the coqui integration
# when coqui would remove a run folder that holds no checkpoint).
OWN_FILES = ("nonfinite_events.jsonl", "dropped_samples.jsonl", "oom_events.jsonl",
             "loss_scale.jsonl", "training_patches.log")


def own_files_in(folder: str) -> list[str]:
    """The names in ``folder`` of files the patches write, each rank's included
    (``nonfinite_events.rank1.jsonl``)."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    return [n for n in names if n in OWN_FILES or _base_name(n) in OWN_FILES]


def _base_name(name: str) -> str:
    """``nonfinite_events.rank1.jsonl`` -> ``nonfinite_events.jsonl`` (else ``name``)."""
    stem, ext = os.path.splitext(name)
    head, dot, tail = stem.rpartition(".")
    if dot and tail.startswith("rank") and tail[4:].isdigit():
        return head + ext
    return name


# Batch keys that name samples (coqui XTTS: ``filenames``; other loaders: paths or ids).
SAMPLE_KEYS = ("filenames", "audio_file", "audio_files", "audio_paths", "wav_file", "wav_files",
               "paths", "audio_unique_name", "utt_ids", "utt_id", "sample_ids", "keys",
               "item_idxs")


def sample_ids(batch: Any) -> list[str]:
    """Identifiers of the samples in a batch: a dict's first list of names under one of
    :data:`SAMPLE_KEYS` (tensors, such as token ids, are never taken for names)."""
    if not isinstance(batch, dict):
        return []
    for key in SAMPLE_KEYS:
        value = batch.get(key)
        if isinstance(value, (list, tuple)) and value and not any(
                hasattr(v, "shape") for v in value[:1]):
            return [str(v) for v in value]
        if isinstance(value, str):
            return [value]
    return []


def set_output_dir(path: str | os.PathLike[str] | None) -> None:
    """Where this run's patch files go (None: back to the option/env default)."""
    global _output_dir
    _output_dir = None if path is None else os.fspath(path)


def set_trainer_dir(path: str | os.PathLike[str] | None) -> None:
    """The trainer's own output folder (an integration's default, below the user's choice)."""
    global _trainer_dir
    _trainer_dir = None if path is None else os.fspath(path)


_dir_providers: list[Callable[[], str | None]] = []


def register_dir_provider(provider: Callable[[], str | None]) -> None:
    """An integration's way to tell where its trainer writes (asked last, newest first)."""
    if provider not in _dir_providers:
        _dir_providers.append(provider)


def output_dir() -> str | None:
    """set_output_dir(), else TRAINING_PATCHES_OUTPUT_DIR, else the trainer's folder (as an
    integration reported it, or as a registered provider finds it)."""
    found = _output_dir or _options.current().output_dir or _trainer_dir
    for provider in reversed(_dir_providers):
        if found:
            break
        found = provider()
    return found or _checkpoint_dir or None


def saw_checkpoint(path: str | os.PathLike[str]) -> None:
    """A checkpoint is being written to ``path``: its folder is the run's, unless a better
    one is known (a plain loop tells us nothing else)."""
    global _checkpoint_dir
    text = os.fspath(path)
    if text.endswith(CHECKPOINT_SUFFIXES) and "://" not in text:
        _checkpoint_dir = os.path.dirname(os.path.abspath(text))


def saw_checkpoint_folder(folder: str | os.PathLike[str]) -> None:
    """A checkpoint folder the run writes into (a ``CheckpointManager``'s): like
    :func:`saw_checkpoint`, for writers whose files are not named by a ``torch.save``
    path (temporary names, DCP folders)."""
    global _checkpoint_dir
    text = os.fspath(folder)
    if "://" not in text:
        _checkpoint_dir = os.path.abspath(text)


def report_dir() -> str:
    """:func:`output_dir`, else ``./training_patches`` (absolute): reports always have a home."""
    return output_dir() or os.path.abspath(DEFAULT_DIR)


def rank_file_name(name: str) -> str:
    """The name this process writes ``name`` under: unchanged in a single process,
    ``<stem>.rank<R><ext>`` in a job of several ranks (``nonfinite_events.rank1.jsonl``),
    so no two processes ever append to one file. A rank above 0 whose launcher gave no
    world size (coqui's ``trainer.distribute`` sets ``RANK`` only) is a job of several."""
    rank, world = _dist.rank(), _dist.world_size()
    if world <= 1 and rank == 0:
        return name
    stem, ext = os.path.splitext(name)
    return f"{stem}.rank{rank}{ext}"


NONFINITE = {math.inf: "Infinity", -math.inf: "-Infinity"}


def strict_json(value: Any) -> Any:
    """``value`` with every non-finite float (in dicts, lists, tuples) replaced by the
    string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"``: bare NaN is not JSON."""
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "NaN" if math.isnan(value) else NONFINITE[value]
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def json_line(record: dict[str, Any]) -> str:
    """One strict JSON line (no newline) for ``record``; objects JSON lacks become str."""
    return json.dumps(strict_json(record), ensure_ascii=False, default=str, allow_nan=False)


RUN_ID_ENV = "TRAINING_PATCHES_RUN_ID"
_run_id: str | None = None


def run_id() -> str:
    """The run this process's records belong to, so that runs started from one folder can
    be told apart in a shared file: ``TRAINING_PATCHES_RUN_ID`` when set; else torchrun's
    rendezvous id (``TORCHELASTIC_RUN_ID``, the same on every rank of a job) unless it is
    torchrun's default ``none``; else, in a rank (``RANK`` set: torchrun without a
    rendezvous id, coqui's ``trainer.distribute``), the host and the launcher's pid, shared
    by the ranks it started; else this process's start time and pid. Made once per process (a forked DataLoader worker keeps its
    parent's); never exported, so separate runs that one driver starts stay separate."""
    global _run_id
    if _run_id is not None:
        return _run_id
    found = os.environ.get(RUN_ID_ENV)
    if found:
        _run_id = found
        return found
    elastic = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if elastic and elastic != "none":
        found = elastic
    elif "RANK" in os.environ or "LOCAL_RANK" in os.environ:
        found = f"{socket.gethostname()}-{os.getppid()}"
    else:
        found = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    _run_id = found
    return found


def with_rank(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with the ``"run_id"``, ``"rank"`` and ``"world_size"`` of this process
    (the record's own keys win)."""
    return {"run_id": run_id(), "rank": _dist.rank(), "world_size": _dist.world_size(),
            **record}


def append_jsonl(name: str, record: dict[str, Any]) -> str:
    """Append one JSON line to this rank's ``name`` (:func:`rank_file_name`) in
    :func:`report_dir`, with the rank and world size; return the file's path."""
    folder = report_dir()
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, rank_file_name(name))
    line = json_line(with_rank(record))
    with _lock, open(path, "a", encoding="utf-8") as handle:
        handle.write(line + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    return path


def reset() -> None:
    """Forget the output folders, the batch in hand and the trainer step."""
    global _output_dir, _trainer_dir, _checkpoint_dir, trainer_step
    _output_dir = _trainer_dir = _checkpoint_dir = trainer_step = None
    batch_ids.clear()


def live_modules() -> Iterator[Any]:
    """Every live ``torch.nn.Module``, from one scan of the garbage collector's objects.

    How the patches find the model of a plain loop, which never names it: only when it is
    needed (a bad step's parameter names; an optimizer's first step under
    ``TRAINING_PATCHES_BASE_VOCAB``), never per step, where a global module hook would cost
    a call on every forward of every module.
    """
    for obj in gc.get_objects():
        # type(), not isinstance(): the latter asks __class__ of lazy deprecated proxies
        if issubclass(type(obj), torch.nn.Module):
            yield obj
