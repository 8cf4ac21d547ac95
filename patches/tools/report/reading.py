"""Find the runs under a folder and read what they wrote, without trusting any of it.

A run leaves its files in one or two folders:

- the trainer's run folder: the coqui Trainer's ``trainer_0_log.txt`` and TensorBoard
  ``events.out.tfevents.*``, and the patches' ``nonfinite_events.jsonl``,
  ``loss_scale.jsonl``, ``oom_events.jsonl`` and ``learning_health.jsonl`` (the reading
  gap, its verdicts, the resume checks) when no output folder was set (a plain loop
  writes them beside its checkpoints);
- the output folder above it: ``headless_runs.jsonl`` (headlessXttsTrain.py) and
  ``dropped_samples.jsonl``, and the patches' files when an output folder was set.

The trainers that keep their own logs are read too, for the losses, the learning rate and
the gradient norm: the Hugging Face Trainer's ``trainer_state.json`` (its ``log_history``,
in ``output_dir`` and each ``checkpoint-N/``: the folder holding them is the run),
Lightning's ``CSVLogger`` ``metrics.csv`` (its version folder is the run), and, besides the
coqui Trainer's tags, the TensorBoard tags the HF Trainer (``train/loss``) and a Lightning
module (``train_loss``, ...) write (:func:`trainer_series`).

A job of several ranks writes one file per rank (``nonfinite_events.rank1.jsonl``,
:func:`patches._run.rank_file_name`): they are read as the records of the plain name,
merged, each record keeping its ``"rank"`` (taken from the file name when an older
writer left it out). Records of a single process have no rank file and may have no rank.

:func:`find_runs` returns one :class:`Run` per trainer run folder, with the files of the
folders above it (up to the folder asked about) shared into it. A JSON line that is not
a JSON object is counted, never fatal; so is an unreadable TensorBoard file.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from typing import Any

from ... import _run, _runlock
from ..._log import logger

# the run's own files, named where the patches write them (patches._run)
EVENTS, DROPPED, OOM, SCALE, LEARNING = (_run.EVENTS_FILE, _run.DROPPED_FILE, _run.OOM_FILE,
                                         _run.SCALE_FILE, _run.LEARNING_FILE)
HEADLESS = "headless_runs.jsonl"  # headlessXttsTrain.RUNS_NAME
TRAINER_RUNS = _run.TRAINER_RUNS_FILE  # a trainer integration's starts, ends, interruptions
JSONL_FILES = (EVENTS, DROPPED, OOM, SCALE, HEADLESS, TRAINER_RUNS, LEARNING)
TB_PREFIX = "events.out.tfevents."
# Files that make a folder a trainer's own run folder, not only an output folder above one:
# the step records, written where the run's report folder is (patches._run.report_dir).
_RUN_FILES = (EVENTS, OOM, SCALE, LEARNING)
MAX_DEPTH = 3  # <output-dir>/<run>/... is depth 1; deeper trees are not searched
HF_STATE = "trainer_state.json"  # the Hugging Face Trainer's, in output_dir and checkpoint-N/
HF_CHECKPOINT = re.compile(r"^checkpoint-\d+$")
CSV_METRICS = "metrics.csv"  # Lightning's CSVLogger, in its version folder
# The series a trainer logs under its own names (after the coqui Trainer's TrainIterStats/):
# the HF Trainer's (TensorBoard "train/loss", trainer_state.json "loss"), and what Lightning
# modules and their callbacks commonly log (self.log("train_loss"), LearningRateMonitor's
# "lr-AdamW"); the first name found is read.
SERIES_NAMES = {
    "loss": ("train/loss", "loss", "train_loss", "train_loss_step", "training_loss",
             "train/loss_step", "loss_step"),
    "lr": ("train/learning_rate", "learning_rate", "lr", "lr-*"),
    "grad_norm": ("train/grad_norm", "grad_norm", "grad_norm_step", "grad_2.0_norm_total"),
}


@dataclass
class Run:
    """What one run wrote: its folders, its records and its TensorBoard scalars."""

    folder: str
    shared_folders: list[str] = field(default_factory=list)
    records: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    files: dict[str, list[str]] = field(default_factory=dict)
    broken_lines: dict[str, int] = field(default_factory=dict)  # file -> unreadable lines
    scalars: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    tb_files: list[str] = field(default_factory=list)
    tb_problem: str | None = None  # the TensorBoard files could not be read at all
    tb_incomplete: list[str] = field(default_factory=list)  # a file cut off or damaged
    newest: float = 0.0  # mtime of its newest file
    run_ids: list[str] = field(default_factory=list)  # set when a folder held several runs
    # the trainer's own logs (trainer_state.json, metrics.csv): name -> series, and its file
    logged: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    logged_from: str | None = None
    # the HF Trainer's newest state: its path, global_step and max_steps
    hf_state: dict[str, Any] | None = None

    def get(self, name: str) -> list[dict[str, Any]]:
        """The records of every ``name`` file of this run (run folder first)."""
        return self.records.get(name, [])

    @property
    def broken(self) -> int:
        return sum(self.broken_lines.values())


def split_rank_name(name: str) -> tuple[str, int | None]:
    """``nonfinite_events.rank1.jsonl`` -> (``nonfinite_events.jsonl``, 1); a plain name
    -> (name, None)."""
    stem, ext = os.path.splitext(name)
    head, dot, tail = stem.rpartition(".")
    if dot and tail.startswith("rank") and tail[4:].isdigit():
        return head + ext, int(tail[4:])
    return name, None


def _is_jsonl(name: str) -> bool:
    return split_rank_name(name)[0] in JSONL_FILES


def rank_of(record: dict[str, Any]) -> int | None:
    """The rank that wrote ``record``; None for a single process's record without one."""
    value = record.get("rank")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def ranks(run: "Run") -> list[int]:
    """The ranks whose records the run holds, when it was a job of several ranks ([]
    for a single process: no record names a rank above 0 or a world size above 1)."""
    found: set[int] = set()
    several = False
    for records in run.records.values():
        for record in records:
            rank = rank_of(record)
            world = record.get("world_size")
            several |= bool(rank) or (isinstance(world, int) and world > 1)
            found.add(rank or 0)
    return sorted(found) if several else []


def read_jsonl(path: str) -> tuple[list[dict[str, Any]], int]:
    """The JSON objects of a JSON-lines file, and how many non-empty lines were not one."""
    records: list[dict[str, Any]] = []
    broken = 0
    with open(path, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError:
                broken += 1
                continue
            if isinstance(value, dict):
                records.append(value)
            else:
                broken += 1
    return records, broken


def _has_tb(names: list[str]) -> bool:
    return any(n.startswith(TB_PREFIX) for n in names)


def _is_trainer_log(name: str) -> bool:
    return name.startswith("trainer_") and name.endswith("_log.txt")


def _is_csv_metrics(folder: str, names: list[str]) -> bool:
    """A Lightning CSVLogger's ``metrics.csv`` (its header has a ``step`` column)."""
    if CSV_METRICS not in names:
        return False
    try:
        with open(os.path.join(folder, CSV_METRICS), encoding="utf-8", errors="replace") as f:
            return "step" in next(csv.reader(f), [])
    except OSError:
        return False


def _trainer_logs(folder: str, names: list[str]) -> bool:
    """The folder holds a trainer's own logs: the HF Trainer's state (in it or in a
    ``checkpoint-N/`` below it), or a Lightning ``metrics.csv``."""
    return (HF_STATE in names or _is_csv_metrics(folder, names)
            or any(HF_CHECKPOINT.match(n) and os.path.isfile(os.path.join(folder, n, HF_STATE))
                   for n in names))


def _marker_folders(root: str) -> dict[str, list[str]]:
    """Folder -> its file and folder names, for every folder under ``root`` holding a run's
    file (an HF ``checkpoint-N/`` counts for the folder above it)."""
    found: dict[str, list[str]] = {}
    root = os.path.abspath(root)
    base_depth = root.rstrip(os.sep).count(os.sep)
    for folder, dirs, names in os.walk(root):
        if folder.rstrip(os.sep).count(os.sep) - base_depth >= MAX_DEPTH:
            dirs[:] = []
        # a side folder's records are read with the folder they are beside (_side_names)
        dirs[:] = sorted(d for d in dirs if not _runlock.is_side_folder(d))
        if folder != root and HF_CHECKPOINT.match(os.path.basename(folder)):
            dirs[:] = []  # an HF checkpoint's files are the folder above's (its state)
            continue
        if any(_is_jsonl(n) or n.startswith(TB_PREFIX) or _is_trainer_log(n)
               for n in names) or _trainer_logs(folder, names + dirs) or _side_names(folder):
            found[folder] = sorted(names + dirs)
    return found


def _side_names(folder: str) -> list[str]:
    """The record files in the hidden folder beside ``folder`` where a trainer integration
    keeps its lock and ``trainer_runs.jsonl`` (:func:`patches._runlock.side_folder`)."""
    try:
        return sorted(n for n in os.listdir(_runlock.side_folder(folder)) if _is_jsonl(n))
    except OSError:
        return []


def find_runs(root: str, *, scalars: bool = True) -> list[Run]:
    """Every run under ``root`` (``root`` itself included), newest last; [] when none.

    A folder with TensorBoard files, a coqui ``trainer_N_log.txt`` or the patches' step
    records is a run folder; a folder above run folders (an output folder) shares its
    files into each of them. An output folder with no run folder below it is a run itself.
    """
    folders = _marker_folders(root)
    own = [f for f, names in folders.items()
           if _has_tb(names) or any(_is_trainer_log(n) for n in names)
           or any(split_rank_name(n)[0] in _RUN_FILES for n in names)
           or _trainer_logs(f, names)]
    # A plain loop's folder is a run, unless a trainer's run folder lies below it: then
    # its records (written there because an output folder was set) belong to that run.
    own = [f for f in own if not any(o != f and o.startswith(f + os.sep) for o in own)
           or _has_tb(folders[f])]
    if not own:
        own = [f for f in folders if not any(o != f and f.startswith(o + os.sep)
                                             for o in folders)]
    runs = []
    for folder in own:
        shared = [f for f in folders if f != folder and f not in own
                  and folder.startswith(f + os.sep)]
        run = Run(folder=folder, shared_folders=sorted(shared, key=len))
        for place in [folder, *run.shared_folders]:
            _read_folder(run, place, folders[place])
            _read_folder(run, str(_runlock.side_folder(place)), _side_names(place))
        read_trainer_logs(run, folders)
        if scalars:
            read_scalars(run, [n for n in folders[folder] if n.startswith(TB_PREFIX)])
        runs.extend(split_by_run_id(run))
    runs.sort(key=lambda r: r.newest)
    return runs


def run_cwd(record: dict[str, Any], run: Run) -> str | None:
    """The folder the run's relative paths were relative to: the working directory the
    record carries (headlessXttsTrain.py writes ``cwd``) while it still holds the run;
    else, for a relative ``run_folder`` that the run's folder ends with (a record of an
    older writer, or a folder copied elsewhere), the folder above that ending; else None."""
    cwd = record.get("cwd")
    folder = record.get("run_folder")
    if isinstance(cwd, str) and os.path.isabs(cwd) and (
            not isinstance(folder, str) or os.path.isabs(folder)
            or os.path.normpath(os.path.join(cwd, folder)) == run.folder):
        return cwd
    if isinstance(folder, str) and not os.path.isabs(folder):
        tail = os.path.normpath(folder)
        if tail != os.curdir and run.folder.endswith(os.sep + tail):
            return run.folder[:-len(tail) - 1] or os.sep
    return cwd if isinstance(cwd, str) and os.path.isabs(cwd) else None


def recorded_path(record: dict[str, Any], path: Any, run: Run) -> str | None:
    """A path a record names, resolved as the run resolved it (:func:`run_cwd`); None
    when it is relative and nothing says what it was relative to."""
    if not isinstance(path, str) or not path:
        return None
    if os.path.isabs(path):
        return os.path.normpath(path)
    cwd = run_cwd(record, run)
    return None if cwd is None else os.path.normpath(os.path.join(cwd, path))


def names_run(record: dict[str, Any], run: Run) -> bool | None:
    """Whether a headless_runs.jsonl record is about ``run``: True without a
    ``run_folder``, or when it resolves to the run's folder; None when it is relative and
    cannot be resolved."""
    if record.get("run_folder") is None:
        return True
    folder = recorded_path(record, record.get("run_folder"), run)
    return None if folder is None else folder == run.folder


def record_step(record: dict[str, Any]) -> int | None:
    """The step a record names: the trainer's counter where the writer knew it, else the
    patch's own count (``step``); None when neither is a whole number."""
    for key in ("trainer_step", "step"):
        value = record.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    return None


def split_by_run_id(run: Run) -> list[Run]:
    """``run`` as one Run per training run its folder holds, told apart by ``run_id``.

    Every process has its own run_id, so a resume has a new one too: a run_id whose
    steps all come after the steps of the run before it continues that run (a resume);
    one whose steps go back over them is another run that wrote into the same folder.
    Only the folder's step records (events, scale changes, out-of-memory batches, the
    learning records' evaluations and resume checks) decide;
    the other records follow their run_id (records without one, from older writers, go
    with the first run; those of a run_id with no steps here, with the newest)."""
    order: list[str] = []
    spans: dict[str, list[int]] = {}
    for name in _RUN_FILES:
        for record in run.records.get(name, []):
            run_id = record.get("run_id")
            step = record_step(record)
            if not isinstance(run_id, str) or step is None:
                continue
            if run_id not in spans:
                order.append(run_id)
                spans[run_id] = [step, step]
            span = spans[run_id]
            span[0], span[1] = min(span[0], step), max(span[1], step)
    if len(order) < 2:
        return [run]
    chains: list[list[str]] = []  # in the order the files first name them
    ends: list[int] = []
    for run_id in order:
        first, end = spans[run_id]
        if chains and first > ends[-1]:
            chains[-1].append(run_id)
            ends[-1] = max(ends[-1], end)
        else:
            chains.append([run_id])
            ends.append(end)
    if len(chains) < 2:
        return [run]
    chain_of = {run_id: i for i, chain in enumerate(chains) for run_id in chain}
    parts = [Run(folder=run.folder, shared_folders=list(run.shared_folders), run_ids=chain,
                 newest=run.newest - (len(chains) - 1 - i) * 1e-6)
             for i, chain in enumerate(chains)]
    for name, records in run.records.items():
        for record in records:
            run_id = record.get("run_id")
            index = chain_of.get(run_id, 0 if not isinstance(run_id, str) else len(chains) - 1)
            parts[index].records.setdefault(name, []).append(record)
    for part in parts:
        part.files = {name: paths for name, paths in run.files.items() if name in part.records}
    parts[0].broken_lines = dict(run.broken_lines)  # lines without a readable run_id
    newest = parts[-1]  # TensorBoard files are the newest run's (coqui: one per run folder)
    newest.scalars, newest.tb_files = run.scalars, run.tb_files
    newest.tb_problem, newest.tb_incomplete = run.tb_problem, run.tb_incomplete
    return parts


def _read_folder(run: Run, folder: str, names: list[str]) -> None:
    for name in names:
        path = os.path.join(folder, name)
        try:
            run.newest = max(run.newest, os.path.getmtime(path))
        except OSError:
            continue
        base, rank = split_rank_name(name)
        if base not in JSONL_FILES:
            continue
        try:
            records, broken = read_jsonl(path)
        except OSError as exc:
            logger.warning("report: cannot read %s (%s)", path, exc)
            run.broken_lines[path] = run.broken_lines.get(path, 0) + 1
            continue
        if rank is not None:  # a rank's own file: its records are that rank's
            for record in records:
                if rank_of(record) is None:
                    record["rank"] = rank
        run.records.setdefault(base, []).extend(records)
        run.files.setdefault(base, []).append(path)
        if broken:
            run.broken_lines[path] = broken


def tfrecord_damage(path: str) -> str | None:
    """Why the TFRecord framing of a TensorBoard file does not add up, or None if it does.

    An event file is a chain of records: an 8-byte little-endian length, its 4-byte CRC,
    the data, the data's 4-byte CRC. TensorBoard's reader stops quietly at a record that
    ends past the end of the file, so a run killed mid-write, a full disk or a file cut
    in a copy would look like a shorter, healthy run; walking the lengths tells."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as handle:
            position = records = 0
            while position < size:
                head = handle.read(12)
                if len(head) < 12:
                    return (f"{path} ends inside a record header at byte {position:,} of "
                            f"{size:,}, after {records} complete record(s)")
                (length,) = struct.unpack("<Q", head[:8])
                end = position + 12 + length + 4
                if end > size:
                    return (f"{path} is truncated: record {records + 1} at byte {position:,} "
                            f"says {length:,} bytes of data, but the file ends at byte "
                            f"{size:,}; only the {records} record(s) before it were read")
                handle.seek(length + 4, os.SEEK_CUR)
                position = end
                records += 1
    except OSError as exc:
        return f"{path} could not be read ({exc})"
    return None


def read_scalars(run: Run, tb_names: list[str]) -> None:
    """The TensorBoard scalars of the run folder, by tag, as (step, value) sorted by step.

    Uses the event reader of ``tensorboard`` (a dependency of the coqui Trainer), imported
    only here; a missing package or an unreadable file is noted in ``run.tb_problem``.
    """
    run.tb_files = [os.path.join(run.folder, n) for n in tb_names]
    if not tb_names:
        return
    run.tb_incomplete = [problem for problem in map(tfrecord_damage, run.tb_files) if problem]
    try:
        from tensorboard.backend.event_processing import (  # lazy: tensorboard is optional
            event_accumulator)
    except ImportError:
        run.tb_problem = ("the tensorboard package is not installed, so the TensorBoard files "
                          "were not read (pip install tensorboard)")
        return
    by_tag: dict[str, dict[int, float]] = {}
    for path in run.tb_files:  # one file each: a resumed run adds a file, steps go on
        try:
            acc = event_accumulator.EventAccumulator(
                path, size_guidance={event_accumulator.SCALARS: 0})
            acc.Reload()
            for tag in acc.Tags().get("scalars", []):
                series = by_tag.setdefault(tag, {})
                for event in acc.Scalars(tag):
                    series[int(event.step)] = float(event.value)
        except Exception as exc:  # noqa: BLE001 - a damaged file is reported, not fatal
            run.tb_incomplete.append(f"{path} could not be read fully "
                                     f"({type(exc).__name__}: {exc})")
    run.scalars = {tag: sorted(values.items()) for tag, values in by_tag.items()}


def _hf_state(path: str) -> dict[str, Any] | None:
    """An HF ``trainer_state.json``'s ``global_step`` (-1: none), ``max_steps`` and
    ``log_history``; None when unreadable."""
    try:
        with open(path, encoding="utf-8") as handle:
            state = json.load(handle)
        step, history = state.get("global_step"), state.get("log_history")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(history, list):
        return None
    return {"path": path, "log_history": history, "max_steps": state.get("max_steps"),
            "global_step": step if isinstance(step, int) and not isinstance(step, bool) else -1}


def _number(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _series(rows: list[tuple[Any, dict[str, Any]]], names: tuple[str, ...]
            ) -> list[tuple[int, float]]:
    """(step, value) of the first of ``names`` (``lr-*``: any name so starting) that ``rows``
    hold, by step."""
    keys = {k for _, row in rows for k, v in row.items() if v not in (None, "")}
    for name in names:
        found = sorted(k for k in keys if k == name or (name.endswith("*")
                                                        and k.startswith(name[:-1])))
        if not found:
            continue
        series: dict[int, float] = {}
        for step, row in rows:
            value = _number(row.get(found[0]))
            if isinstance(step, int) and value is not None:
                series[step] = value
        return sorted(series.items())
    return []


def read_trainer_logs(run: Run, folders: dict[str, list[str]]) -> None:
    """The losses, learning rate and gradient norm a trainer logged in its own files, from
    the run's folder or a folder above it (the first that has them): the HF Trainer's
    ``trainer_state.json`` of the most steps (``output_dir``'s or a ``checkpoint-N/``'s:
    each holds the history up to it), else Lightning's ``metrics.csv``."""
    for place in [run.folder, *run.shared_folders]:
        names = folders.get(place, [])
        paths = [os.path.join(place, HF_STATE)] if HF_STATE in names else []
        paths += [os.path.join(place, n, HF_STATE) for n in names if HF_CHECKPOINT.match(n)]
        states = [state for path in paths if (state := _hf_state(path)) is not None]
        if states:
            newest = max(states, key=lambda state: state["global_step"])
            rows = [(entry.get("step"), entry) for entry in newest.pop("log_history")
                    if isinstance(entry, dict)]
            run.logged_from, run.hf_state = newest["path"], newest
        elif _is_csv_metrics(place, names):
            path = os.path.join(place, CSV_METRICS)
            try:
                with open(path, encoding="utf-8", errors="replace", newline="") as handle:
                    rows = [(_whole_step(row.get("step")), row) for row in csv.DictReader(handle)]
            except (OSError, csv.Error) as exc:
                logger.warning("report: cannot read %s (%s)", path, exc)
                continue
            run.logged_from = path
        else:
            continue
        run.logged = {kind: series for kind, names_ in SERIES_NAMES.items()
                      if (series := _series(rows, names_))}
        return


def _whole_step(value: Any) -> int | None:
    number = _number(value)
    return int(number) if number is not None and number.is_integer() and number >= 0 else None


def trainer_series(run: Run, kind: str) -> tuple[list[tuple[int, float]], str | None]:
    """The run's ``kind`` series (``loss``, ``lr``, ``grad_norm``) under a trainer's own
    names (:data:`SERIES_NAMES`) when the coqui Trainer's tags are not there: TensorBoard
    first, then the trainer's files (:func:`read_trainer_logs`); with where it was read
    (None: nowhere)."""
    rows = [(step, {tag: value}) for tag, series in run.scalars.items()
            for step, value in series]
    series = _series(rows, SERIES_NAMES[kind])
    if series:
        return series, "TensorBoard"
    if run.logged.get(kind):
        return run.logged[kind], run.logged_from
    return [], None


def scalar(run: Run, name: str, group: str = "TrainIterStats") -> list[tuple[int, float]]:
    """The series whose tag is ``<...group>/<name>`` (coqui prefixes a model name at times)."""
    for tag, series in run.scalars.items():
        head, _, tail = tag.rpartition("/")
        if tail == name and head.endswith(group):
            return series
    return []
