"""The figures of a run and the verdict they support.

:func:`facts` turns what :mod:`.reading` found into plain figures (steps, skipped steps
and why, the loss trend, the loss scale's backoffs, dropped samples, the frozen-row
check); :func:`verdict` names what needs a look. A run is *healthy* only when nothing
does: any recorded event (a skipped step, a dropped sample, an out-of-memory batch, an
unreadable record) keeps it from being called healthy.

A job of several ranks is one run: a step every rank skipped is one skipped step (the
ranks agree on the decision), told apart by who saw the bad value (its event's kind)
and who only followed a peer (``"kind": "peer_nonfinite"``); the loss scale is read
from one rank (every rank's scaler takes the same steps); out-of-memory batches are
summed (each rank's batch is its own); a sample dropped on several ranks counts once.

Learning (``learning_health.jsonl``, :mod:`patches.learning` and :mod:`patches.resume_check`):
each language's reading gap over the evaluations (read from one rank), the live monitor's
verdicts (a finding while not cleared later in the run) and the resume checks (a finding
for each problem). A run that measured no reading gap is never said to read its text: its
learning is "not checked", whatever the verdict on its stability.
"""

from __future__ import annotations

import math
import os
import socket
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ... import learning
from ...checkpoint.atomic import pid_alive
from .freeze_check import describe_new_rows
from . import reading
from .reading import Run

# Thresholds, with why:
STALL_MIN_POINTS = 8     # fewer logged losses say nothing about a trend
STALL_MIN_DROP = 0.01    # the last quarter's mean loss must be 1% below the first quarter's
REPEAT_SHARE = 0.01      # two or more skips in over 1% of the steps are no accident
UNSTABLE_BACKOFFS = 3    # ... and a scale that backs off 3+ times, in over 2% of the steps
UNSTABLE_SHARE = 0.02
SCALE_FLOOR = 1.0        # below 1.0 the gradients overflow unscaled (see grad_scaler)

HEALTHY = "healthy"
UNSTABLE_SCALE = "unstable scale"
STALLED_LOSS = "stalled loss"
REPEATED_SKIPS = "repeated skips"
FROZEN_MOVED = "frozen rows moved"
SKIPPED = "skipped steps"
DROPPED = "dropped samples"
OOM = "out-of-memory batches"
UNREADABLE = "unreadable records"
IMPOSSIBLE = "impossible records"
TB_INCOMPLETE = "incomplete TensorBoard file"
NOT_CHECKED = "checks not run"
UNWRITTEN = "records not written"
INTERRUPTED = "interrupted"
FAILED = "stopped by an error"
# a live verdict of patches.learning still holding at the run's end is named by its kind,
# language and step: "not reading the text (am) since step 1200" (learning.NOT_READING, ...)
LR_DISCONTINUITY = "LR discontinuity at resume"  # + " (step N)"
STATE_MISFIT = "optimizer state does not fit at resume"
# patches.resume_check's problem kinds, by the finding they make
LR_PROBLEMS = ("fresh_optimizer", "lr_not_scheduler", "scheduler_steps")
STATE_PROBLEMS = ("moments",)
LEARNING_DEFAULTS = {o.name: o.default for o in learning.SPEC.options}
# how a live verdict ended, said after "from step A to step B"
CLEARED_AS = {learning.NOT_READING: "then read", learning.BELOW_BASE: "then caught up",
              learning.NO_IMPROVEMENT: "then improved"}


PEER = "peer_nonfinite"  # patches.nan_guard: this rank skipped because a peer saw it


@dataclass
class Skip:
    """One optimizer step that did not update the weights (once, however many ranks)."""

    step: int
    kind: str  # nonfinite_loss, nonfinite_grad, loss_spike, overflow (peer_nonfinite:
    #            only followers' records were found)
    loss: float | None = None
    seen_on: list[int] = field(default_factory=list)      # ranks that saw the bad value
    followed_on: list[int] = field(default_factory=list)  # ranks that followed a peer


@dataclass
class RankFigures:
    """What one rank of a job of several recorded."""

    seen: int = 0        # skipped steps where this rank saw the bad value
    followed: int = 0    # skipped steps this rank took only because a peer saw one
    micro_batches: int = 0
    overflows: int = 0
    ooms: int = 0
    dropped: int = 0


@dataclass
class ReadingPoint:
    """One language's reading gap at one evaluation (``reading`` record); None: not recorded,
    a float: as recorded ("NaN" read as nan)."""

    step: int | None
    own: float | None
    rotated: float | None
    gap: float | None
    relative: float | None
    share: float | None
    utterances: int | None
    eval_loss: float | None = None
    measured_on: str = learning.AUDIO_LOSS
    rank: int = 0
    stderr: float | None = None  # the gap's standard error over the utterances


@dataclass
class LiveVerdict:
    """A verdict the live monitor gave (``verdict`` record) and, when it ended, how."""

    kind: str
    language: str | None
    since: int | None  # the step it holds from (the record's ``since``, else its step)
    warned_at: int | None
    detail: str
    ended_at: int | None = None
    ended: str | None = None  # None: holds at the run's end; "cleared"; "resumed" (see below)
    run_id: str | None = None  # the process that gave it last
    ranks: list[int] = field(default_factory=list)

    @property
    def holds(self) -> bool:
        return self.ended is None

    @property
    def what(self) -> str:
        """``not reading the text (am)``, ``no improvement``."""
        return self.kind + (f" ({self.language})" if self.language else "")

    @property
    def name(self) -> str:
        """``not reading the text (am) since step 1200``, ``no improvement since step 3000``."""
        return self.what + (f" since step {self.since}" if self.since is not None else "")


@dataclass
class ResumeCheck:
    """One resume as :mod:`patches.resume_check` compared it (``resume`` record)."""

    step: int | None
    optimizer_steps: int | None
    scheduler_steps: int | None
    lr: list[Any]
    scheduler_lr: list[Any] | None
    planned_lr: list[Any] | None
    problems: list[str]
    details: list[str]
    ranks: list[int] = field(default_factory=list)

    @property
    def at(self) -> int | None:
        """The step a finding names: the trainer's, else the optimizer's count."""
        return self.step if self.step is not None else self.optimizer_steps


@dataclass
class Facts:
    """Every figure the report shows, read from one run's files."""

    run: Run
    steps: int = 0
    steps_known: bool = False  # False: ``steps`` is only a lower bound (nothing recorded it)
    skips: list[Skip] = field(default_factory=list)
    micro_batches: list[int] = field(default_factory=list)  # non-finite, left out, not skipped
    overflows: list[int] = field(default_factory=list)  # steps the scaler skipped (NaN loss too)
    longest_streak: int = 0
    losses: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    scale: list[tuple[int, float]] = field(default_factory=list)
    scale_source: str | None = None
    backoffs: int = 0
    lr: list[tuple[int, float]] = field(default_factory=list)
    grad_norm: list[tuple[int, float]] = field(default_factory=list)
    dropped: Counter[str] = field(default_factory=Counter)
    dropped_splits: Counter[str] = field(default_factory=Counter)
    ooms: int = 0
    freeze: dict[str, Any] | None = None
    new_rows: dict[str, Any] | None = None  # the base load's row_init (its start record)
    patch_stats: dict[str, dict[str, float]] = field(default_factory=dict)
    ranks: dict[int, RankFigures] = field(default_factory=dict)  # {} for one process
    impossible: Counter[str] = field(default_factory=Counter)  # file -> records left out
    not_checked: list[str] = field(default_factory=list)  # checks that could not run, why
    interrupted: dict[str, Any] | None = None  # the run's last record, when it is a stop
    failed: dict[str, Any] | None = None  # the run's last record, when it is an error
    running: dict[str, Any] | None = None  # the start of a run whose process still runs
    loss_source: str | None = None  # where the losses were read (None: nowhere)
    readings: dict[str, list[ReadingPoint]] = field(default_factory=dict)  # language -> by step
    live_verdicts: list[LiveVerdict] = field(default_factory=list)  # holding or ended
    resumes: list[ResumeCheck] = field(default_factory=list)
    not_measured: list[str] = field(default_factory=list)  # why the gap was not measured
    probe: dict[str, Any] | None = None  # the probe record: languages, measured_on, thresholds

    @property
    def learning_checked(self) -> bool:
        """Whether any reading gap was measured (else learning was not checked at all)."""
        return bool(self.readings)


@dataclass
class Finding:
    name: str
    detail: str


def number(value: Any) -> float | None:
    """A record's number: an int or float, or the strict-JSON strings ``"NaN"``,
    ``"Infinity"``, ``"-Infinity"`` (:func:`patches._run.strict_json`); else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if value in ("NaN", "Infinity", "-Infinity"):
        return float(value.replace("Infinity", "inf"))
    return None


def _finite(series: list[tuple[int, float]]) -> list[tuple[int, float]]:
    return [(s, v) for s, v in series if math.isfinite(v)]


_step_of = reading.record_step


def _impossible(record: dict[str, Any], name: str) -> str | None:
    """What a step record holds that no writer of the patches writes (a NaN, negative or
    fractional step, a loss scale that is not a positive finite number), or None."""
    for key in ("step", "trainer_step"):
        value = record.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                isinstance(value, float) and not value.is_integer()) or value < 0:
            return f"{key} {value!r}"
    if name == reading.SCALE:
        for key in ("scale", "scale_before"):
            value = number(record.get(key))
            if key in record and (value is None or not math.isfinite(value) or value <= 0):
                return f"{key} {record.get(key)!r}"
    return None


def _steps_at_least(record: dict[str, Any]) -> int:
    """How many steps a run that wrote ``record`` took at least: the trainer's counter
    starts at 0, the patches' own counts at 1."""
    trainer = record.get("trainer_step")
    if isinstance(trainer, int) and not isinstance(trainer, bool):
        return trainer + 1
    step = _step_of(record)
    return step if step is not None else 0


def _streak(steps: list[int]) -> int:
    longest = run = 0
    previous = None
    for step in sorted(set(steps)):
        run = run + 1 if previous is not None and step == previous + 1 else 1
        longest = max(longest, run)
        previous = step
    return longest


# Counters of what one rank saw (patches.stats()): a job's figure is their sum over ranks.
# Every other counter holds the same value on every rank (an agreed decision, the scale):
# a job's figure is one rank's.
PER_RANK = ("nonfinite_losses", "nonfinite_grads", "spikes", "skipped_micro_batches",
            "peer_skips", "oom_skipped",
            "written", "waiting", "lost", "write_failures")  # evidence: each rank its own files


def _patch_stats(run: Run) -> dict[str, dict[str, float]]:
    """The patches' counters of each process of the run (headless_runs.jsonl), summed;
    across the ranks of one job only :data:`PER_RANK` counters add up, the agreed ones
    are taken once."""
    folder_ends = [r for r in run.get(reading.HEADLESS)
                   if r.get("event") in ("finished", "interrupted")
                   and isinstance(r.get("patch_stats"), dict)
                   and reading.names_run(r, run)]
    by_rank: dict[int | None, list[dict[str, Any]]] = {}
    for record in folder_ends:
        by_rank.setdefault(reading.rank_of(record), []).append(record)
    total: dict[str, dict[str, float]] = {}
    for records in by_rank.values():
        for patch, counts in _sum_stats(records).items():
            into = total.setdefault(patch, {})
            for name, value in counts.items():
                into[name] = (into.get(name, 0) + value if name in PER_RANK
                              else max(into.get(name, value), value))
    return total


def _sum_stats(folder_ends: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """One process line's counters (a run and its resumes), summed."""
    total: dict[str, dict[str, float]] = {}
    for record in folder_ends:
        for patch, counts in record["patch_stats"].items():
            if not isinstance(counts, dict):
                continue
            into = total.setdefault(patch, {})
            for name, value in counts.items():
                if isinstance(value, (int, float)) and name not in (
                        "scale", "enabled", "consecutive_skips", "waiting"):  # now, not a count
                    into[name] = into.get(name, 0) + value
                elif isinstance(value, (int, float)):
                    into[name] = value
    return total


def _names_folder(recorded: Any, folder: str) -> bool:
    """A record's ``run_folder`` names ``folder``: the run folders of one output folder are
    told apart by their names (the record may hold a path relative to where the run was
    started)."""
    return isinstance(recorded, str) and bool(recorded) and (
        os.path.basename(os.path.normpath(recorded)) == os.path.basename(os.path.normpath(folder)))


def _last_record(run: Run) -> dict[str, Any] | None:
    """The run's last start/stop record that says how it ended: of headless_runs.jsonl
    (headlessXttsTrain.py) and a trainer integration's trainer_runs.jsonl (the coqui
    Trainer's, the HF Trainer's, Lightning's, F5's: in the run's folder or a folder above
    it, as the HF Trainer's output_dir is above its TensorBoard folder), each file's last
    record of this folder counts: an ``interrupted`` one first (the headless one, with more
    to say, before the other), then a ``failed`` one, then a ``start`` that names its host
    and process (the run recorded no end), then any; None when neither file has one."""
    lasts = []
    for name in (reading.HEADLESS, reading.TRAINER_RUNS):
        places = [run.folder] + (run.shared_folders if name == reading.TRAINER_RUNS else [])
        last = None
        for record in run.get(name):
            if (record.get("event") in ("start", "interrupted", "finished", "failed")
                    and any(_names_folder(record.get("run_folder"), p) for p in places)):
                last = record
        if last is not None:
            lasts.append({**last, "recorded_in": name})
    for event in ("interrupted", "failed"):
        found = next((last for last in lasts if last.get("event") == event), None)
        if found is not None:
            return found
    return next((last for last in lasts if _unended(last)), lasts[0] if lasts else None)


def _unended(record: dict[str, Any]) -> bool:
    """A ``start`` that names its host and process: the run recorded no end."""
    return record.get("event") == "start" and isinstance(record.get("host"), str) and \
        isinstance(record.get("pid"), int) and not isinstance(record.get("pid"), bool)


def _ending(run: Run, f: Facts) -> None:
    """How the run ended, from its last start/stop record: stopped by a signal and not
    continued since (``f.interrupted``), stopped by an error (``f.failed``); or, when it
    recorded its start and no end, by its process: gone from this host (killed outright:
    SIGKILL, a SIGTERM nothing handled, out of memory; ``f.interrupted``), still running
    (``f.running``), or on another host (a check not run)."""
    last = _last_record(run)
    state = run.hf_state
    if last is None and state is not None and isinstance(state["max_steps"], int) \
            and 0 <= state["global_step"] < state["max_steps"]:
        f.not_checked.append(
            f"whether the run ended: it recorded no start or end (no {reading.TRAINER_RUNS}: "
            f"the patches were off), and its newest trainer_state.json "
            f"({state['path']}) is at step {state['global_step']} of max_steps "
            f"{state['max_steps']}: stopped, stopped early on purpose, or still running")
    if last is None:
        return
    event = last.get("event")
    if event == "interrupted":
        f.interrupted = last
    elif event == "failed":
        f.failed = last
    elif _unended(last):
        if last["host"] != socket.gethostname():
            f.not_checked.append(
                f"whether the run ended: it recorded its start on {last['host']} (process "
                f"{last['pid']}, {last['recorded_in']}) and no end, and a process of another "
                f"machine cannot be looked at from here")
        elif pid_alive(last["pid"]):
            f.running = last
        else:
            newest = os.path.dirname(state["path"]) if state is not None else ""
            f.interrupted = {**last, "gone": True, "checkpoint": newest if
                             reading.HF_CHECKPOINT.match(os.path.basename(newest)) else None}


def _cause_rank(kind: str) -> int:
    return _CAUSE.index(kind) if kind in _CAUSE else len(_CAUSE)


_CAUSE = ("nonfinite_loss", "loss_spike", "nonfinite_grad")


def _skips_of_events(run: Run, f: Facts) -> tuple[dict[int, Skip], list[int]]:
    """Skipped steps from the NaN guard's events of every rank, each step once."""
    skips: dict[int, Skip] = {}
    streaks = [0]
    for event in run.get(reading.EVENTS):
        step = _step_of(event)
        if step is None:
            continue
        rank = reading.rank_of(event) or 0
        if event.get("micro_batch"):
            f.micro_batches.append(step)
            f.ranks.setdefault(rank, RankFigures()).micro_batches += 1
            continue
        kind = str(event.get("kind", "nonfinite"))
        skip = skips.setdefault(step, Skip(step, kind))
        if kind == PEER:
            skip.followed_on.append(rank)
            f.ranks.setdefault(rank, RankFigures()).followed += 1
        else:
            # the seeing rank names the kind; a NaN loss (the cause) over the NaN gradients
            # DDP's all-reduce carries from it to the other ranks
            if not skip.seen_on or _cause_rank(kind) < _cause_rank(skip.kind):
                skip.kind, skip.loss = kind, number(event.get("loss"))
            skip.seen_on.append(rank)
            f.ranks.setdefault(rank, RankFigures()).seen += 1
        consecutive = event.get("consecutive")
        if isinstance(consecutive, int):
            streaks.append(consecutive)
    for skip in skips.values():  # a rank names a step once (a record written twice counts once)
        skip.seen_on = sorted(set(skip.seen_on))
        skip.followed_on = sorted(set(skip.followed_on))
    return skips, streaks


def facts(run: Run) -> Facts:
    """The figures of ``run`` (all its ranks)."""
    f = Facts(run=run)
    several = reading.ranks(run)
    _leave_out_impossible(run, f)
    skips, streaks = _skips_of_events(run, f)
    all_scale = [r for r in run.get(reading.SCALE) if _step_of(r) is not None]
    # every rank's scaler takes the same steps (found-inf is agreed): the series of one
    first_rank = min((reading.rank_of(r) or 0 for r in all_scale), default=0)
    scale_records = sorted((r for r in all_scale if (reading.rank_of(r) or 0) == first_rank),
                           key=lambda r: (_step_of(r) or 0))
    overflows: set[int] = set()
    guard_steps = set(skips)
    for record in sorted(all_scale, key=lambda r: (_step_of(r) or 0)):
        step = _step_of(record) or 0
        if not record.get("overflow"):
            continue
        rank = reading.rank_of(record) or 0
        overflows.add(step)
        f.ranks.setdefault(rank, RankFigures()).overflows += 1
        if step in guard_steps:  # the guard's events say who saw it
            continue
        if step not in skips:
            loss = number(record.get("loss"))  # a NaN batch under a scaler is its overflow
            bad_loss = loss is not None and not math.isfinite(loss)
            skips[step] = Skip(step, "nonfinite_loss" if bad_loss else "overflow", loss)
        if rank not in skips[step].seen_on:
            skips[step].seen_on.append(rank)
    f.overflows = sorted(overflows)
    f.skips = sorted(skips.values(), key=lambda s: s.step)
    f.longest_streak = max(max(streaks), _streak([s.step for s in f.skips]))

    for name in ("loss", "loss_text_ce", "loss_mel_ce"):
        series = _finite(reading.scalar(run, name))
        if series:
            f.losses[name] = series
    f.loss_source = "TensorBoard" if f.losses else None
    f.lr = _finite(reading.scalar(run, "current_lr"))
    grad_norm = _finite(reading.scalar(run, "grad_norm"))
    if not f.losses:  # another trainer's own names (the HF Trainer's, a Lightning module's)
        series, f.loss_source = reading.trainer_series(run, "loss")
        if series:
            f.losses["loss"] = series
        f.lr = f.lr or reading.trainer_series(run, "lr")[0]
        grad_norm = grad_norm or reading.trainer_series(run, "grad_norm")[0]
    skipped = set(skips)  # coqui logs a non-finite norm as 0: a skipped step has none
    f.grad_norm = [(s, v) for s, v in grad_norm if s not in skipped]

    if scale_records:
        f.scale_source = reading.SCALE
        first = number(scale_records[0].get("scale_before"))
        if first is not None:  # the scale the run started with
            f.scale.append((min(0, _step_of(scale_records[0]) or 0), first))
        for record in scale_records:
            value = number(record.get("scale"))
            before = number(record.get("scale_before"))
            if value is not None:
                f.scale.append((_step_of(record) or 0, value))
                if before is not None and value < before:
                    f.backoffs += 1
    else:
        for name, group in (("amp_scaler", "TrainIterStats"),
                            ("grad_scaler_scale", "TrainingPatches")):
            series = _finite(reading.scalar(run, name, group))
            if series:
                f.scale, f.scale_source = series, "TensorBoard " + name
                f.backoffs = sum(b < a for (_, a), (_, b) in zip(series, series[1:]))
                break

    keys: set[str] = set()
    for record in run.get(reading.DROPPED):
        f.ranks.setdefault(reading.rank_of(record) or 0, RankFigures()).dropped += 1
        key = record.get("key")
        if isinstance(key, str):  # the same sample dropped on several ranks counts once
            if key in keys:
                continue
            keys.add(key)
        f.dropped[str(record.get("reason", "unknown"))] += 1
        f.dropped_splits[str(record.get("split", "?"))] += 1
    f.ooms = len(run.get(reading.OOM))
    for record in run.get(reading.OOM):
        f.ranks.setdefault(reading.rank_of(record) or 0, RankFigures()).ooms += 1
    if several:
        for rank in several:
            f.ranks.setdefault(rank, RankFigures())
        f.ranks = dict(sorted(f.ranks.items()))
    else:
        f.ranks = {}
    f.patch_stats = _patch_stats(run)
    _ending(run, f)
    _learning(run, f)
    guard_steps = int(f.patch_stats.get("nan_guard", {}).get("steps", 0))
    if guard_steps:  # the guard's own count of the run's optimizer steps, recorded at its end
        f.steps, f.steps_known = guard_steps, True
    else:  # a lower bound: the last step anything names
        seen = [s + 1 for series in (*f.losses.values(), f.lr, f.grad_norm)
                for s, _ in series[-1:]]
        seen += [_steps_at_least(r) for name in (reading.EVENTS, reading.SCALE, reading.OOM,
                                                 reading.LEARNING, reading.TRAINER_RUNS)
                 for r in run.get(name)]
        f.steps = max([0] + seen)
    _checks_not_run(run, f)
    return f


def _whole(value: Any) -> int | None:
    return reading.record_step({"step": value})


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _reading_point(record: dict[str, Any], rank: int) -> ReadingPoint:
    return ReadingPoint(
        step=_whole(record.get("step")), own=number(record.get("own")),
        rotated=number(record.get("rotated")), gap=number(record.get("gap")),
        relative=number(record.get("relative")), share=number(record.get("share")),
        utterances=_whole(record.get("utterances")), eval_loss=number(record.get("eval_loss")),
        measured_on=str(record.get("measured_on") or learning.AUDIO_LOSS), rank=rank,
        stderr=number(record.get("stderr")))


def _live_verdicts(stream: list[dict[str, Any]], thresholds: dict[str, Any]
                   ) -> list[LiveVerdict]:
    """The live verdicts of one rank's learning records (in the order written): each open
    from its ``verdict`` record to the ``cleared`` record of its kind and language.

    A resumed process's monitor starts afresh and clears only what it warned itself: a
    verdict of an earlier process ends (``"resumed"``) when a later one measured enough
    evaluations to give it again (past ``reading_warmup``, :data:`learning.CONFIRM` in a
    row; more than ``reading_patience`` for no improvement) and did not."""
    warmup = int(thresholds.get("reading_warmup", LEARNING_DEFAULTS["reading_warmup"]))
    patience = int(thresholds.get("reading_patience", LEARNING_DEFAULTS["reading_patience"]))
    ended: list[LiveVerdict] = []
    open_: dict[tuple[str, str | None], LiveVerdict] = {}
    processes: list[Any] = []  # run_ids in the order they wrote
    measured: Counter[tuple[Any, str | None]] = Counter()  # (run_id, language) -> readings
    evaluations: dict[Any, set[Any]] = {}
    first_step: dict[Any, int | None] = {}
    for record in stream:
        event, run_id = record.get("event"), record.get("run_id")
        step = _whole(record.get("step"))
        if run_id not in processes:
            processes.append(run_id)
        key = (str(record.get("kind")), _text(record.get("language")))
        if event == "reading":
            measured[(run_id, _text(record.get("language")))] += 1
            evaluations.setdefault(run_id, set()).add(step)
            first_step.setdefault(run_id, step)
        elif event == "verdict":
            since = _whole(record.get("since"))
            verdict = open_.setdefault(key, LiveVerdict(
                key[0], key[1], since if since is not None else step, step,
                str(record.get("detail") or "")))
            verdict.run_id = run_id
        elif event == "cleared" and key in open_:
            verdict = open_.pop(key)
            verdict.ended_at, verdict.ended = step, "cleared"
            ended.append(verdict)
    for key, verdict in list(open_.items()):
        for later in processes[processes.index(verdict.run_id) + 1:]:
            enough = (len(evaluations.get(later, ())) > patience
                      if verdict.kind == learning.NO_IMPROVEMENT
                      else measured[(later, verdict.language)] >= warmup + learning.CONFIRM)
            if enough:
                verdict.ended_at, verdict.ended = first_step.get(later), "resumed"
                ended.append(open_.pop(key))
                break
    return ended + list(open_.values())


def _learning(run: Run, f: Facts) -> None:
    """The reading gap, the live verdicts and the resume checks of learning_health.jsonl.

    Readings of a language are one rank's (the first that measured it: every rank that
    measures reads the same probe); a verdict given on several ranks, or a resume every
    rank checked alike, counts once, naming its ranks."""
    streams: dict[int, list[dict[str, Any]]] = {}
    for record in run.get(reading.LEARNING):
        streams.setdefault(reading.rank_of(record) or 0, []).append(record)
    verdicts: dict[tuple[Any, ...], LiveVerdict] = {}
    resumes: dict[tuple[Any, ...], ResumeCheck] = {}
    for rank, stream in sorted(streams.items()):
        for record in stream:
            event = record.get("event")
            if event == "probe" and f.probe is None:
                f.probe = {k: record.get(k) for k in ("languages", "measured_on", "thresholds")}
            elif event == "reading":
                language = str(record.get("language"))
                points = f.readings.setdefault(language, [])
                if not points or points[0].rank == rank:
                    points.append(_reading_point(record, rank))
            elif event == "not_measured":
                why = str(record.get("reason") or "no reason recorded")
                if why not in f.not_measured:
                    f.not_measured.append(why)
            elif event == "resume":
                check = ResumeCheck(
                    _whole(record.get("step")), _whole(record.get("optimizer_steps")),
                    _whole(record.get("scheduler_steps")), list(record.get("lr") or []),
                    record.get("scheduler_lr"), record.get("planned_lr"),
                    [str(p) for p in record.get("problems") or []],
                    [str(d) for d in record.get("details") or []])
                same = resumes.setdefault((check.at, tuple(check.problems)), check)
                same.ranks.append(rank)
        thresholds = (f.probe or {}).get("thresholds")
        for verdict in _live_verdicts(stream, thresholds if isinstance(thresholds, dict)
                                      else {}):
            same = verdicts.setdefault((verdict.kind, verdict.language, verdict.since,
                                        verdict.ended, verdict.ended_at), verdict)
            same.ranks.append(rank)
    for points in f.readings.values():
        points.sort(key=lambda p: (p.step is None, p.step or 0))
    f.live_verdicts = list(verdicts.values())
    f.resumes = sorted(resumes.values(), key=lambda c: (c.at is None, c.at or 0))


def _leave_out_impossible(run: Run, f: Facts) -> None:
    """Records with values no writer of the patches makes are counted per file, and left
    out of every figure (never a traceback, never a silent skip)."""
    for name in (reading.EVENTS, reading.SCALE, reading.OOM, reading.LEARNING):
        kept = []
        for record in run.get(name):
            why = _impossible(record, name)
            if why is None:
                kept.append(record)
            else:
                f.impossible[f"{name} ({why})"] += 1
        if name in run.records:
            run.records[name] = kept


def _checks_not_run(run: Run, f: Facts) -> None:
    """What could not be checked, and why: each is a finding (never a silent skip)."""
    if run.tb_problem:
        f.not_checked.append(f"the TensorBoard files: {run.tb_problem}")
    unresolved = sorted({str(r.get("run_folder")) for r in run.get(reading.HEADLESS)
                         if reading.names_run(r, run) is None})
    if unresolved and not any(reading.names_run(r, run) for r in run.get(reading.HEADLESS)
                              if r.get("run_folder") is not None):
        f.not_checked.append(
            f"the patches' counters and freeze in headless_runs.jsonl: it names the relative "
            f"run folder(s) {', '.join(unresolved)} and not the working directory they were "
            f"relative to, so none can be matched with {run.folder}")


def verdict(f: Facts) -> list[Finding]:
    """What needs a look in the run, each with the figures behind it; [] when healthy."""
    found: list[Finding] = []
    steps = max(f.steps, 1)
    if f.interrupted is not None:
        found.append(Finding(INTERRUPTED, _interrupted_detail(f.interrupted)))
    if f.failed is not None:
        stop = f.failed
        found.append(Finding(FAILED, (
            f"stopped at trainer step {stop.get('step', '?')} by "
            f"{stop.get('error') or 'an error'}, and not continued since "
            f"({stop.get('recorded_in', reading.HEADLESS)})")))
    not_checked = list(f.not_checked)
    if f.freeze is not None and f.freeze.get("checked") is False:
        not_checked.append(f"the frozen rows: {f.freeze['detail']}")
    if f.freeze is not None and f.freeze.get("moved"):
        found.append(Finding(FROZEN_MOVED, f"frozen base rows moved by up to "
                                           f"{f.freeze['max_drift']:.3g} ({f.freeze['detail']})"))
    found.extend(_resume_findings(f))
    if f.scale:
        values = [v for _, v in f.scale]
        low = min(values)
        if low < SCALE_FLOOR or (f.backoffs >= UNSTABLE_BACKOFFS
                                 and f.backoffs > UNSTABLE_SHARE * steps):
            found.append(Finding(UNSTABLE_SCALE, (
                f"the loss scale backed off {f.backoffs} times in {f.steps} steps, from "
                f"{values[0]:g} down to {low:g} (ends at {values[-1]:g})"
                + ("; below 1.0 the gradients overflow even unscaled" if low < SCALE_FLOOR
                   else ""))))
    if f.skips:
        kinds = Counter(s.kind for s in f.skips)
        where = ", ".join(str(s.step) for s in f.skips[:8]) + (" ..." if len(f.skips) > 8 else "")
        detail = (f"{len(f.skips)} of {f.steps} steps skipped "
                  f"({100.0 * len(f.skips) / steps:.1f}%): " if f.steps_known else
                  f"{len(f.skips)} skipped steps in at least {f.steps} (the run's total "
                  f"number of steps was not recorded): ")
        detail += (", ".join(f"{n} {k.replace('_', ' ')}" for k, n in kinds.most_common())
                  + f"; at step {where}; longest streak {f.longest_streak}")
        repeated = f.longest_streak >= 2 or (len(f.skips) >= 2
                                             and len(f.skips) > REPEAT_SHARE * steps)
        found.append(Finding(REPEATED_SKIPS if repeated else SKIPPED, detail))
    loss = f.losses.get("loss") or f.losses.get("loss_mel_ce") or []
    if len(loss) >= STALL_MIN_POINTS:
        quarter = max(len(loss) // 4, 1)
        first = sum(v for _, v in loss[:quarter]) / quarter
        last = sum(v for _, v in loss[-quarter:]) / quarter
        drop = (first - last) / abs(first) if first else 0.0
        if drop < STALL_MIN_DROP:
            found.append(Finding(STALLED_LOSS, (
                f"mean loss of the first {quarter} logged steps {first:.4g}, of the last "
                f"{quarter} {last:.4g} ({-100 * drop:+.1f}%, less than a "
                f"{100 * STALL_MIN_DROP:g}% drop)")))
    found.extend(_learning_findings(f))
    if f.dropped:
        found.append(Finding(DROPPED, f"{sum(f.dropped.values())} dropped: "
                             + ", ".join(f"{r} {n}" for r, n in f.dropped.most_common())))
    if f.ooms:
        found.append(Finding(OOM, f"{f.ooms} batches skipped for lack of GPU memory "
                                  f"(oom_events.jsonl)"))
    if f.run.tb_incomplete:  # the figures above may miss the run's last steps
        found.append(Finding(TB_INCOMPLETE, "; ".join(f.run.tb_incomplete)
                             + " (the run was stopped while writing it, the disk filled, the "
                               "file was cut in a copy, or it is still being written: the "
                               "figures end where it does)"))
    if f.run.broken:
        found.append(Finding(UNREADABLE, "; ".join(
            f"{n} unreadable lines in {p}" for p, n in f.run.broken_lines.items())
            + " (the figures leave them out)"))
    if f.impossible:
        found.append(Finding(IMPOSSIBLE, "; ".join(
            f"{n} record(s) of {what}" for what, n in f.impossible.items())
            + " (values no run writes: the figures leave them out)"))
    if not_checked:
        found.append(Finding(NOT_CHECKED, "; ".join(not_checked)))
    evidence = f.patch_stats.get("evidence", {})
    unwritten = int(evidence.get("waiting", 0)) + int(evidence.get("lost", 0))
    if unwritten:  # the run's own count: its files (and these figures) miss them
        found.append(Finding(UNWRITTEN, (
            f"{unwritten} record(s) of the patches could not be written when the run ended "
            f"(a full disk, a read-only folder, a file-size limit; headless_runs.jsonl's "
            f"patch_stats.evidence): the figures above miss them; the run's log names the "
            f"file and the error, and lists the records")))
    return found


def _interrupted_detail(stop: dict[str, Any]) -> str:
    """Why the run is called interrupted, and how to continue it."""
    where = f" ({stop.get('recorded_in', reading.HEADLESS)})"
    how = stop.get("continue_with")
    checkpoint = stop.get("checkpoint")
    name = os.path.basename(str(checkpoint)) if checkpoint else None
    if stop.get("gone"):
        return (f"the run started at trainer step {stop.get('step', '?')} (process "
                f"{stop.get('pid')}) and recorded no end, and that process is gone from this "
                f"machine: it was killed (SIGKILL, a SIGTERM nothing handled, out of memory) "
                f"or died; continue it from its newest checkpoint"
                + (f" ({name})" if name else "") + (f" with {how}" if how else "") + where)
    return (f"stopped by {stop.get('signal') or 'a signal'} at trainer step "
            f"{stop.get('step', '?')} and not continued since; "
            + (f"{name} was written: continue it with --resume auto" if name and not how
               else f"its newest checkpoint is {name}: continue it with {how}" if name
               else f"no checkpoint was written: start it again" + (
                   f" ({how} resumes from the newest one there is)" if how else ""))
            + where)


def _fmt(value: float | None, spec: str = ".3g") -> str:
    """A recorded number as the text shows it: "NaN"/"Infinity" as written, "?" if missing."""
    if value is None:
        return "?"
    if not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return format(value, spec)


def _reading_text(point: ReadingPoint) -> str:
    """``gap 0.41 ± 0.031 nats/code (13.1% of the audio loss), own text lower for 94% of 32
    utterances`` (the ± where the record has the gap's standard error)."""
    unit = " nats/code" if point.measured_on == learning.AUDIO_LOSS else ""
    error = (f" ± {_fmt(point.stderr, '.2g')}" if point.stderr is not None
             and math.isfinite(point.stderr) else "")
    return (f"gap {_fmt(point.gap)}{error}{unit} ({_fmt(point.relative, '.2%')} of the "
            f"{point.measured_on}), own text lower for {_fmt(point.share, '.0%')} of "
            f"{point.utterances if point.utterances is not None else '?'} utterances")


def _at(step: int | None) -> str:
    return f"step {step}" if step is not None else "a step not recorded"


def _on_ranks(ranks: list[int], f: Facts) -> str:
    return f", on {_ranks_text(sorted(set(ranks)))}" if f.ranks else ""


def _learning_findings(f: Facts) -> list[Finding]:
    """One finding per live verdict still holding at the run's end (per kind and language,
    from its earliest step)."""
    holding: dict[tuple[str, str | None], LiveVerdict] = {}
    for verdict in f.live_verdicts:
        key = (verdict.kind, verdict.language)
        if verdict.holds and (key not in holding or (verdict.since or 0) < (
                holding[key].since or 0)):
            holding[key] = verdict
    found = []
    for verdict in holding.values():
        points = f.readings.get(verdict.language or "", [])
        last = (f"; last reading at {_at(points[-1].step)}: {_reading_text(points[-1])}"
                if points else "")
        found.append(Finding(verdict.name, (
            f"{verdict.detail} (the live monitor warned at {_at(verdict.warned_at)}"
            f"{_on_ranks(verdict.ranks, f)}, learning_health.jsonl{last})")))
    return found


def _resume_findings(f: Facts) -> list[Finding]:
    """Per checked resume: its LR problems as one finding, its optimizer state as another."""
    found: dict[str, Finding] = {}
    for check in f.resumes:
        said = dict(zip(check.problems, check.details))
        for name, kinds in ((LR_DISCONTINUITY, LR_PROBLEMS), (STATE_MISFIT, STATE_PROBLEMS)):
            mine = [p for p in check.problems if p in kinds]
            if not mine:
                continue
            name += f" (step {check.at})" if check.at is not None else ""
            detail = "; ".join(said.get(p, p.replace("_", " ")) for p in mine) + (
                f" (resume_check: {', '.join(mine)}; {_resume_figures(check)}"
                f"{_on_ranks(check.ranks, f)})")
            if name in found:
                detail = found[name].detail + "; " + detail
            found[name] = Finding(name, detail)
    return list(found.values())


def _lrs(values: list[Any] | None) -> str:
    if not values:
        return "not recorded"
    shown = [_fmt(number(v)) for v in values]
    return shown[0] if len(set(shown)) == 1 else "[" + ", ".join(shown) + "]"


def _resume_figures(check: ResumeCheck) -> str:
    """``LR 4.78e-05, the scheduler's 4.78e-05; optimizer steps 0, scheduler steps 26000``."""
    def count(value: int | None) -> str:
        return str(value) if value is not None else "?"

    return (f"LR {_lrs(check.lr)}, the scheduler's {_lrs(check.scheduler_lr)}; optimizer "
            f"steps {count(check.optimizer_steps)}, scheduler steps "
            f"{count(check.scheduler_steps)}")


def _learning_lines(f: Facts) -> list[str]:
    """Learning in the text: the last reading of each language, the verdicts that held and
    ended, each resume check; or, with no reading, that learning was not checked."""
    if not f.learning_checked:
        why = ("; ".join(f.not_measured) if f.not_measured
               else f"{reading.LEARNING} holds no reading" if f.run.files.get(reading.LEARNING)
               else f"no {reading.LEARNING}; the learning patch was off, or the run never "
                    f"evaluated")
        lines = [f"learning: not checked (no reading gap measured: {why})"]
    else:
        lines = [f"learning {language}: {_reading_text(points[-1])}, at {_at(points[-1].step)} "
                 f"({len(points)} evaluation(s))" for language, points in f.readings.items()]
        lines += [f"learning: not measured: {why}" for why in f.not_measured]
    for verdict in f.live_verdicts:
        if verdict.ended == "cleared":
            lines.append(f"learning: {verdict.what} from {_at(verdict.since)} to "
                         f"{_at(verdict.ended_at)}, "
                         + CLEARED_AS.get(verdict.kind, "then no longer"))
        elif verdict.ended == "resumed":
            lines.append(f"learning: {verdict.what} from {_at(verdict.since)}; not found "
                         f"again after the resume (readings from {_at(verdict.ended_at)} on)")
    for check in f.resumes:
        lines.append(f"resume at {_at(check.at)}: "
                     + (", ".join(check.problems) if check.problems else "consistent")
                     + f" ({_resume_figures(check)})")
    return lines


def _ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _rank_lines(f: Facts) -> list[str]:
    """A job of several ranks: who saw each skipped step, who followed, per-rank counts."""
    lines = [f"ranks: {len(f.ranks)} ({', '.join(map(str, f.ranks))}); a step skipped on "
             f"every rank counts once"]
    for skip in f.skips[:10]:
        parts = []
        if skip.seen_on:
            parts.append(f"seen on {_ranks_text(skip.seen_on)}")
        if skip.followed_on:
            parts.append(f"followed on {_ranks_text(skip.followed_on)}")
        if not skip.seen_on:
            parts.append("no rank's record says it saw the bad value")
        lines.append(f"  step {skip.step} ({skip.kind}): " + ", ".join(parts))
    for rank, r in f.ranks.items():
        extra = "".join(f", {n} {what}" for n, what in (
            (r.micro_batches, "micro-batches left out"), (r.overflows, "overflows"),
            (r.ooms, "out-of-memory batches"), (r.dropped, "dropped samples")) if n)
        lines.append(f"  rank {rank}: saw {r.seen} bad step(s), followed a peer in "
                     f"{r.followed}{extra}")
    return lines


def headline(findings: list[Finding]) -> str:
    """``healthy``, or the names of the findings, worst first."""
    return ", ".join(dict.fromkeys(x.name for x in findings)) if findings else HEALTHY


def describe(f: Facts, findings: list[Finding]) -> list[str]:
    """The report's text: where the run is, its figures, the verdict."""
    run = f.run
    lines = [f"run: {run.folder}" + (f" (run_id {', '.join(run.run_ids)})" if run.run_ids
                                     else "")]
    for folder in run.shared_folders:
        lines.append(f"  with the files of {folder}")
    loss = f.losses.get("loss", [])
    lines.append(f"steps: {f.steps if f.steps_known else f'at least {f.steps} (not recorded)'}"
                 + (f"; loss {loss[0][1]:.4g} at step {loss[0][0]} -> "
                                        f"{loss[-1][1]:.4g} at step {loss[-1][0]} "
                                        f"({len(loss)} logged, from {f.loss_source})" if loss
                                        else "; no loss logged (TensorBoard, the HF Trainer's "
                                             "trainer_state.json, Lightning's metrics.csv)"))
    if f.running is not None:
        lines.append(f"running: process {f.running.get('pid')} on this machine, started "
                     f"{f.running.get('time', '?')}, has recorded no end yet")
    kinds = Counter(s.kind for s in f.skips)
    lines.append(f"skipped steps: {len(f.skips)}" + (
        " (" + ", ".join(f"{k} {n}" for k, n in kinds.items()) + ") at steps "
        + ", ".join(str(s.step) for s in f.skips[:10])
        + (" ..." if len(f.skips) > 10 else "") if f.skips else ""))
    if f.micro_batches:
        lines.append(f"non-finite micro-batches left out (step not skipped): "
                     f"{len(f.micro_batches)}")
    if f.ranks:
        lines.extend(_rank_lines(f))
    events = run.get(reading.EVENTS)
    samples = Counter(s for e in events if e.get("kind") != PEER  # a follower's batch was fine
                      for s in (e.get("samples") or []) if isinstance(s, str))
    if samples:
        lines.append("samples seen most in bad batches: " + ", ".join(
            f"{s} ({n})" for s, n in samples.most_common(5)))
    sources = [e["source"] for e in events if e.get("source")]
    if sources:
        lines.append(f"where the first NaN appeared: {sources[0]}")
    if f.scale:
        lines.append(f"loss scale: {f.scale[0][1]:g} -> {f.scale[-1][1]:g}, {f.backoffs} "
                     f"backoffs (from {f.scale_source})")
    else:
        lines.append("loss scale: none recorded (no GradScaler: fp32 or bf16)")
    lines.append(f"dropped samples: {sum(f.dropped.values())}" + (
        " (" + ", ".join(f"{r} {n}" for r, n in f.dropped.most_common()) + ")"
        if f.dropped else ""))
    if f.ooms:
        lines.append(f"out-of-memory batches skipped: {f.ooms}")
    guard = f.patch_stats.get("nan_guard")
    if guard:
        lines.append(f"nan_guard counters (headless_runs.jsonl): skipped "
                     f"{int(guard.get('skipped', 0))} of {int(guard.get('steps', 0))} steps")
    if f.new_rows is not None:
        lines.append(f"new rows: {describe_new_rows(f.new_rows)}")
    if f.freeze is not None:
        lines.append(f"frozen rows: {f.freeze['detail']}")
    lines.extend(_learning_lines(f))
    if run.tb_problem:
        lines.append(f"TensorBoard: {run.tb_problem}")
    for problem in run.tb_incomplete:
        lines.append(f"TensorBoard: {problem}")
    for path, n in run.broken_lines.items():
        lines.append(f"{n} unreadable line(s) in {path}")
    lines.append(f"verdict: {headline(findings)}")
    for finding in findings:
        lines.append(f"  - {finding.name}: {finding.detail}")
    return lines
