"""What the patches know about the run they are in: where it writes, which batch is in hand.

Integrations fill this in (:func:`set_batch`, :func:`set_trainer_dir`); a plain loop can call
:func:`set_output_dir` or set ``TRAINING_PATCHES_OUTPUT_DIR``. Each rank writes its own files
(:func:`rank_file_name`), every record strict JSON (:func:`json_line`) with its ``rank``,
``world_size`` and :func:`run_id`. Writing is best effort (:func:`append_line`): a record
that cannot be written waits in memory (:class:`Writer`) and never raises into training.

Design: docs/design/run.md
"""

from __future__ import annotations

import atexit
import gc
import json
import math
import os
import socket
import threading
import time
from typing import Any, Callable, Iterator

import torch

from . import _dist, _options, _runstate
from ._log import logger
from ._runstate import current

_lock = threading.Lock()
# Where reports go when no run folder is known at all (a plain loop before its first save).
DEFAULT_DIR = "training_patches"
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".tar", ".safetensors")

# The files the patches write into a run's folder, named here only.
EVENTS_FILE = "nonfinite_events.jsonl"  # nan_guard: bad steps and micro-batches
DROPPED_FILE = "dropped_samples.jsonl"  # dataset_guard: samples left out
OOM_FILE = "oom_events.jsonl"  # oom_guard: out-of-memory batches
SCALE_FILE = "loss_scale.jsonl"  # grad_scaler: loss-scale changes
LOG_FILE = "training_patches.log"
# a trainer integration: each fit's start, its interruption by a signal, its end
TRAINER_RUNS_FILE = "trainer_runs.jsonl"
LEARNING_FILE = "learning_health.jsonl"  # learning: the reading gap, its verdicts, resume checks
# (kept by the coqui integration when coqui would remove a run folder with no checkpoint)
OWN_FILES = (EVENTS_FILE, DROPPED_FILE, OOM_FILE, SCALE_FILE, LOG_FILE, TRAINER_RUNS_FILE,
             LEARNING_FILE)


def own_files_in(folder: str) -> list[str]:
    """The names in ``folder`` of files the patches write, each rank's included
    (``nonfinite_events.rank1.jsonl``)."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    return [n for n in names if _base_name(n) in OWN_FILES]


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
    """Where this run's patch files go (None: back to the option/env default). Said after a
    run ended (``revert()``), it is the next run's: that run starts here."""
    _runstate.start().output_dir = None if path is None else os.fspath(path)


def set_trainer_dir(path: str | os.PathLike[str] | None) -> None:
    """The trainer's own output folder (an integration's default, below the user's choice)."""
    _runstate.start().trainer_dir = None if path is None else os.fspath(path)


_dir_providers: list[Callable[[], str | None]] = []


def register_dir_provider(provider: Callable[[], str | None]) -> None:
    """An integration's way to tell where its trainer writes (asked last, newest first)."""
    if provider not in _dir_providers:
        _dir_providers.append(provider)


def output_dir() -> str | None:
    """set_output_dir(), else TRAINING_PATCHES_OUTPUT_DIR, else the trainer's folder (as an
    integration reported it, or as a registered provider finds it)."""
    run = current()
    found = run.output_dir or _options.current().output_dir or run.trainer_dir
    for provider in reversed(_dir_providers):
        if found:
            break
        found = provider()
    return found or run.checkpoint_dir or None


def saw_checkpoint(path: str | os.PathLike[str]) -> None:
    """A checkpoint is being written to ``path``: its folder is the run's, unless a better
    one is known (a plain loop tells us nothing else)."""
    text = os.fspath(path)
    if text.endswith(CHECKPOINT_SUFFIXES) and "://" not in text:
        current().checkpoint_dir = os.path.dirname(os.path.abspath(text))


def saw_checkpoint_folder(folder: str | os.PathLike[str]) -> None:
    """A checkpoint folder the run writes into (a ``CheckpointManager``'s): like
    :func:`saw_checkpoint`, for writers whose files are not named by a ``torch.save``
    path (temporary names, DCP folders)."""
    text = os.fspath(folder)
    if "://" not in text:
        current().checkpoint_dir = os.path.abspath(text)


def report_dir() -> str:
    """:func:`output_dir`, else ``./training_patches`` (absolute): reports always have a home."""
    return output_dir() or os.path.abspath(DEFAULT_DIR)


def rank_file_name(name: str) -> str:
    """The name this process writes ``name`` under: unchanged in a single process, else
    ``<stem>.rank<R><ext>`` (a rank above 0 without a world size counts as several)."""
    rank, world = _dist.rank(), _dist.world_size()
    if world <= 1 and rank == 0:
        return name
    stem, ext = os.path.splitext(name)
    return f"{stem}.rank{rank}{ext}"


def strict_json(value: Any) -> Any:
    """``value`` with every non-finite float (in dicts, lists, tuples) replaced by the
    string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"``: bare NaN is not JSON."""
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
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
    """The run this process's records belong to: ``TRAINING_PATCHES_RUN_ID`` when set; else
    torchrun's ``TORCHELASTIC_RUN_ID`` (the same on every rank) unless it is ``none``; else,
    in a rank (``RANK`` set), the host and the launcher's pid; else this process's start
    time and pid. Made once per process (a forked worker keeps its parent's), never exported."""
    global _run_id
    if _run_id is None:
        elastic = os.environ.get("TORCHELASTIC_RUN_ID", "")
        if os.environ.get(RUN_ID_ENV):
            _run_id = os.environ[RUN_ID_ENV]
        elif elastic and elastic != "none":
            _run_id = elastic
        elif "RANK" in os.environ or "LOCAL_RANK" in os.environ:
            _run_id = f"{socket.gethostname()}-{os.getppid()}"
        else:
            _run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    return _run_id


def with_rank(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with the ``"run_id"``, ``"rank"`` and ``"world_size"`` of this process
    (the record's own keys win)."""
    return {"run_id": run_id(), "rank": _dist.rank(), "world_size": _dist.world_size(),
            **record}


def record_in(folder: str | os.PathLike[str], name: str, event: str, **fields: Any) -> str:
    """Append one ``event`` record (with the time, this process, its working directory, rank
    and run) to this rank's ``name`` in ``folder``, best effort; return the file's path."""
    try:
        cwd: str | None = os.getcwd()
    except OSError:  # the working directory was removed: the record still goes out
        cwd = None
    record = {"event": event, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "pid": os.getpid(),
              "cwd": cwd, **fields}
    path = os.path.join(os.fspath(folder), rank_file_name(name))
    append_line(path, json_line(with_rank(record)))
    return path


def append_jsonl(name: str, record: dict[str, Any]) -> str:
    """Append one JSON line, with the rank and run, to this rank's ``name`` in
    :func:`report_dir`, best effort (:func:`append_line`); return the file's path."""
    path = os.path.join(report_dir(), rank_file_name(name))
    append_line(path, json_line(with_rank(record)))
    return path


# -- evidence is best-effort: a write error never ends a run -------------------------
# (a full disk must not raise from inside optimizer.step(), where torch alone carries on)

MAX_WAITING = 10_000


class Writer:
    """The run's evidence writer: what could not be written yet, and the counts."""

    def __init__(self) -> None:
        self.waiting: dict[str, list[str]] = {}  # path -> lines not written yet, oldest first
        self.failing: dict[str, str] = {}  # path -> the error of its current failure (warned once)
        self.counts = {"written": 0, "lost": 0, "write_failures": 0}


def _writer() -> Writer:
    return current().part(Writer)


def _write_lines(path: str, lines: list[str], *, shared: bool = False,
                 skip_last: Callable[[], bool] | None = None) -> bool:
    """Append ``lines`` to ``path`` whole or not at all (a failed write is cut back to the
    file's old end). ``shared``: other processes append too, so hold an exclusive lock;
    ``skip_last()``, asked under it, leaves the last line out. Returns whether it was
    written."""
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        if shared:
            try:
                import fcntl  # lazy: POSIX only (ImportError caught)
                fcntl.flock(fd, fcntl.LOCK_EX)  # released when fd closes
            except (ImportError, OSError):
                pass
        last = not (skip_last is not None and skip_last())
        data = memoryview("".join(line + "\n" for line in (lines if last else lines[:-1]))
                          .encode("utf-8"))
        start = os.fstat(fd).st_size
        try:
            while data:  # a write may be short at a size limit; the next one then fails
                data = data[os.write(fd, data):]
            os.fsync(fd)
        except OSError:
            try:
                os.ftruncate(fd, start)
            except OSError:
                pass  # the reader counts a broken last line; nothing more can be done here
            raise
    finally:
        os.close(fd)
    return last


def _error_text(exc: OSError) -> str:
    return f"{type(exc).__name__}: [Errno {exc.errno}] {exc.strerror}" if exc.strerror \
        else f"{type(exc).__name__}: {exc}"


def append_line(path: str, line: str, *, shared: bool = False,
                skip: Callable[[], bool] | None = None) -> bool:
    """Append ``line`` (no newline) to ``path``, after any lines still waiting for it. Never
    raises an OSError: a line that cannot be written is kept in memory (at most MAX_WAITING),
    logged once per file and retried later. ``shared``/``skip``: see :func:`_write_lines`.
    Returns False when ``skip()`` left the line out, else True (written, or waiting)."""
    writer = _writer()
    with _lock:
        lines = [*writer.waiting.get(path, ()), line]
        try:
            wrote = _write_lines(path, lines, shared=shared, skip_last=skip)
        except OSError as exc:
            _keep(writer, path, line, exc)
            return True
        _written(writer, path, len(lines) - (not wrote))
    if writer.waiting:
        retry_waiting(writer)
    return wrote


def _keep(writer: Writer, path: str, line: str, exc: OSError) -> None:
    waiting = writer.waiting.setdefault(path, [])
    waiting.append(line)
    if len(waiting) > MAX_WAITING:
        del waiting[0]
        writer.counts["lost"] += 1
    writer.counts["write_failures"] += 1
    if path not in writer.failing:
        writer.failing[path] = _error_text(exc)
        logger.warning(
            "training-patches: could not write to %s (%s); training goes on as it would "
            "without the patches. The record is kept in memory (%d waiting) and written "
            "with the next one or at exit, once the file can be written; "
            "patches.stats()['evidence'] counts what is not written. Free space on that "
            "disk or make the folder writable, or point TRAINING_PATCHES_OUTPUT_DIR at "
            "another folder for the next run.", path, writer.failing[path], len(waiting))


def _written(writer: Writer, path: str, count: int) -> None:
    waited = len(writer.waiting.pop(path, ()))
    writer.counts["written"] += count
    if writer.failing.pop(path, None) is not None and waited:
        logger.warning("training-patches: %s can be written again: the %d record(s) that "
                       "waited in memory are written", path, waited)


def retry_waiting(writer: Writer | None = None) -> None:
    """Try once more to write every line still waiting (each file in turn)."""
    writer = writer or _writer()
    with _lock:
        for path in list(writer.waiting):
            try:
                _write_lines(path, writer.waiting[path])
            except OSError:
                continue
            _written(writer, path, len(writer.waiting[path]))


def where_recorded(path: str) -> str:
    """How a log line names the file a record went to: ``recorded in PATH``, or that it
    waits in memory because PATH cannot be written."""
    writer = _writer()
    if path in writer.waiting:
        return (f"NOT yet recorded in {path} ({writer.failing.get(path, 'write failed')}; "
                f"{len(writer.waiting[path])} record(s) wait in memory)")
    return f"recorded in {path}"


def evidence_stats() -> dict[str, int]:
    """Records ``written``, ``waiting`` in memory (retried), ``lost`` (too many waiting, or
    the run's end or exit with the file still unwritable), and ``write_failures``."""
    writer = _writer()
    return {"written": writer.counts["written"],
            "waiting": sum(len(lines) for lines in writer.waiting.values()),
            "lost": writer.counts["lost"], "write_failures": writer.counts["write_failures"]}


def _give_up(run: _runstate.Run, when: str) -> None:
    """Retry, then log what still waits (the lines themselves, so the log keeps them)."""
    writer = run.existing(Writer)
    if writer is None or not writer.waiting:
        return
    retry_waiting(writer)
    with _lock:
        for path, lines in writer.waiting.items():
            writer.counts["lost"] += len(lines)
            logger.warning("training-patches: %d record(s) could not be written to %s (%s) "
                           "%s and are lost from that file; they were:\n%s", len(lines), path,
                           writer.failing.get(path, "write failed"), when, "\n".join(lines))
        writer.waiting.clear()
        writer.failing.clear()


atexit.register(lambda: _give_up(current(), "at exit"))
_runstate.on_end(lambda run: _give_up(run, "at the end of the run"))


def set_batch(batch: Any, step: int | None) -> None:
    """The batch in hand (its sample ids: :func:`sample_ids`) and the trainer's step count,
    as an integration knows them: events and records name them."""
    run = current()
    run.batch_ids = sample_ids(batch)
    run.trainer_step = step


def live_modules() -> Iterator[Any]:
    """Every live ``torch.nn.Module``, from one scan of the garbage collector's objects: how
    the patches find a plain loop's model, only when needed (never per step)."""
    for obj in gc.get_objects():
        # type(), not isinstance(): the latter asks __class__ of lazy deprecated proxies
        if issubclass(type(obj), torch.nn.Module):
            yield obj


def outermost(modules: list[Any]) -> list[Any]:
    """Those of ``modules`` that are not a submodule of another one of them (in order)."""
    inner = {id(sub) for module in modules for sub in module.modules() if sub is not module}
    return [module for module in modules if id(module) not in inner]
