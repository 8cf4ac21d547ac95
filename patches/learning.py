"""``learning``: is the run learning its text? The reading gap, per language, at every evaluation.

On a fixed held-out probe (:class:`ReadingProbe`), the audio loss with each utterance's own
text against the same audio with another utterance's text of about its length: the **gap**
and the **share** of utterances whose own text gives the lower loss. :func:`reading_gap`
measures it; :class:`LearningMonitor` does it at each evaluation, logs it, writes
``learning_health.jsonl`` and warns (:func:`judge`) when a language is not read
(TRAINING_PATCHES_README.md, "Is it learning?").

Design: docs/design/learning.md
"""

from __future__ import annotations

import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from . import _dist, _options, _run
from ._log import info, logger
from ._options import Option, nonnegative_int, positive_int, share
from ._registry import PatchSpec, register
from .oom_guard import OOM_ERRORS

# The loss of a batch of pairs: (model, texts, audios) -> one loss per pair (a 1-D tensor
# or a sequence of floats), the mean over each utterance's audio codes.
LossFn = Callable[[torch.nn.Module, list[Any], list[Any]], Any]

PROBE_SEED = 20211206  # every call of the loss starts from this seed: paired draws
AUDIO_LOSS = "audio loss"  # what a reading is measured on, unless a model says otherwise


@dataclass(frozen=True)
class Reading:
    """One language's reading at one evaluation."""

    language: str
    utterances: int
    own: float  # mean loss with each utterance's own text
    rotated: float  # mean loss with another utterance's text (:func:`partners`)
    share: float  # utterances whose own text gives the lower loss (0..1)
    measured_on: str = AUDIO_LOSS
    # the gap's standard error over the utterances (their gaps' sample std / sqrt(n)): how
    # far another probe of the same size could put it; NaN under two utterances
    stderr: float = math.nan
    # each utterance's gap, in the probe's order: two models on the same probe compared
    # utterance by utterance (not recorded: the record keeps the figures above)
    gaps: tuple[float, ...] = field(default=(), repr=False, compare=False)

    @property
    def gap(self) -> float:
        """How much lower the loss is with the utterance's own text (nats per code)."""
        return self.rotated - self.own

    @property
    def relative(self) -> float:
        """The gap as a share of the loss with the own text (scale-free across models)."""
        return self.gap / self.own if self.own > 0 else math.nan

    def line(self, step: int | None) -> str:
        """The log line: ``reading am at step 1,200: gap 0.41 ± 0.031 nats/code (13.14% of the
        loss), 94% of 32 utterances, audio loss 3.120``."""
        where = f" at step {step:,}" if step is not None else ""
        unit = " nats/code" if self.measured_on == AUDIO_LOSS else f" ({self.measured_on})"
        error = f" ± {self.stderr:.2g}" if math.isfinite(self.stderr) else ""
        return (f"reading {self.language}{where}: gap {self.gap:.3g}{error}{unit} "
                f"({self.relative:.2%} of the loss), {self.share:.0%} of {self.utterances} "
                f"utterances, {self.measured_on} {self.own:.3f}")

    def record(self) -> dict[str, Any]:
        fields = asdict(self)
        del fields["gaps"]
        return {**fields, "gap": self.gap, "relative": self.relative}


class ReadingProbe:
    """Held-out (text, audio) pairs per language, up to ``per_language`` each (default: the
    ``reading_probe`` option), in whatever form the loss function takes. Once measured, the
    probe is fixed (:meth:`freeze`): later ``add`` calls are refused."""

    def __init__(self, pairs: Mapping[str, Iterable[tuple[Any, Any]]] | None = None, *,
                 per_language: int | None = None) -> None:
        self.per_language = int(per_language or _options.current().reading_probe)
        self._pairs: dict[str, list[tuple[Any, Any]]] = {}
        self.frozen = False
        for language, items in (pairs or {}).items():
            for text, audio in items:
                self.add(language, text, audio)

    def add(self, language: str, text: Any, audio: Any) -> bool:
        """Keep one pair of ``language``; False when the probe is fixed or the language full."""
        if not self.wants(language):  # a refused pair leaves no (empty) language behind
            return False
        self._pairs.setdefault(str(language), []).append((text, audio))
        return True

    def wants(self, language: str) -> bool:
        """Whether :meth:`add` would keep a pair of ``language``."""
        return not self.frozen and len(self._pairs.get(str(language), ())) < self.per_language

    def freeze(self) -> None:
        self.frozen = True

    @property
    def languages(self) -> list[str]:
        """The languages with at least two pairs (one text to give another), in order seen."""
        return [lang for lang, items in self._pairs.items() if len(items) >= 2]

    def pairs(self, language: str) -> list[tuple[Any, Any]]:
        return list(self._pairs.get(language, ()))

    def sizes(self) -> dict[str, int]:
        return {lang: len(items) for lang, items in self._pairs.items()}

    def __len__(self) -> int:
        return sum(len(items) for items in self._pairs.values())


# -- the measurement ---------------------------------------------------------------------------


def _sharded(model: torch.nn.Module) -> bool:
    """FSDP2/tensor-parallel DTensors or DeepSpeed ZeRO-3 partitions (``ds_id``)."""
    return any(_dist.is_dtensor(p) or hasattr(p, "ds_id") for p in model.parameters())


def _cuda_devices() -> list[int]:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return list(range(torch.cuda.device_count()))
    return []


def _per_pair(model: torch.nn.Module, loss_fn: LossFn, texts: list[Any], audios: list[Any],
              seed: int) -> list[float]:
    """One loss per pair: ``loss_fn`` on the whole chunk, or pair by pair when it returns
    one number for the batch. Each call starts from the same seeded RNG."""
    def call(t: list[Any], a: list[Any]) -> Any:
        # torch.manual_seed would also queue a seed for CUDA not yet initialized: the run's
        # first CUDA draws would then start from ours. Seed what fork_rng restores, only.
        torch.default_generator.manual_seed(seed)
        for device in _cuda_devices():
            torch.cuda.default_generators[device].manual_seed(seed)
        random.seed(seed)
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed(seed % 2 ** 32)
        return loss_fn(model, t, a)

    out = call(texts, audios)
    values = out.detach().float().reshape(-1).tolist() if isinstance(out, torch.Tensor) \
        else [float(v) for v in (out if isinstance(out, (list, tuple)) else [out])]
    if len(values) == len(texts):
        return values
    if len(values) == 1:  # a batch mean: one pair at a time
        return [_per_pair(model, loss_fn, [t], [a], seed)[0] for t, a in zip(texts, audios)]
    raise ValueError(f"the loss function returned {len(values)} losses for {len(texts)} "
                     f"pairs; expected one per pair (or one for the batch)")


def _stderr(values: list[float]) -> float:
    """The standard error of the mean of ``values`` (sample std / sqrt(n)); NaN under two
    values or with one not finite."""
    n = len(values)
    if n < 2 or not all(math.isfinite(v) for v in values):
        return math.nan
    mean = math.fsum(values) / n
    return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1) / n)


def partners(texts: Sequence[Any]) -> list[int]:
    """For each pair, the pair whose text it is given: the texts sorted by length and taken
    two by two (three at the end of an odd count). With the lengths matched, the gap measures
    whether the *content* is read, not the length (docs/design/learning.md)."""
    def length(text: Any) -> int:
        try:
            return len(text)
        except TypeError:
            return 0
    order = sorted(range(len(texts)), key=lambda i: (length(texts[i]), i))
    partner = list(range(len(texts)))
    n = len(order)
    for k in range(0, n - 3 if n % 2 else n, 2):
        a, b = order[k], order[k + 1]
        partner[a], partner[b] = b, a
    if n % 2 and n >= 3:
        a, b, c = order[-3:]
        partner[a], partner[b], partner[c] = b, c, a
    return partner


def reading_gap(model: torch.nn.Module, probe: ReadingProbe, loss_fn: LossFn, *,
                batch_size: int = 16, measured_on: str = AUDIO_LOSS) -> dict[str, Reading]:
    """Each language's :class:`Reading` on ``probe``: ``loss_fn`` with each pair's own text,
    and with its :func:`partners`' text. No gradients, eval mode; every module's mode and
    every RNG state are as before when it returns, raise or not. Freezes the probe.
    ``measured_on`` names the loss when it is not an audio loss."""
    probe.freeze()
    modes = [(module, module.training) for module in model.modules()]
    py_state = random.getstate()
    numpy = sys.modules.get("numpy")
    np_state = numpy.random.get_state() if numpy is not None else None
    readings: dict[str, Reading] = {}
    try:
        with torch.random.fork_rng(devices=_cuda_devices()), torch.no_grad():
            model.eval()
            for language in probe.languages:
                pairs = probe.pairs(language)
                texts, audios = (list(side) for side in zip(*pairs))
                given = [texts[j] for j in partners(texts)]
                own: list[float] = []
                other: list[float] = []
                for start in range(0, len(pairs), batch_size):
                    part = slice(start, start + batch_size)
                    seed = PROBE_SEED + start
                    own += _per_pair(model, loss_fn, texts[part], audios[part], seed)
                    other += _per_pair(model, loss_fn, given[part], audios[part], seed)
                n = len(pairs)
                gaps = [r - o for o, r in zip(own, other)]
                readings[language] = Reading(
                    language=language, utterances=n, own=sum(own) / n, rotated=sum(other) / n,
                    share=sum(g > 0 for g in gaps) / n, measured_on=measured_on,
                    stderr=_stderr(gaps), gaps=tuple(gaps))
    finally:
        for module, mode in modes:
            module.training = mode
        random.setstate(py_state)
        if numpy is not None and np_state is not None:
            numpy.random.set_state(np_state)
    return readings


# -- verdicts ----------------------------------------------------------------------------------

NOT_READING = "not reading the text"
BELOW_BASE = "reading far less than another language"
NO_IMPROVEMENT = "no improvement"


@dataclass(frozen=True)
class Verdict:
    """A finding on the run's learning, true from ``since`` (a step) on."""

    kind: str
    since: int | None
    detail: str
    language: str | None = None

    def name(self) -> str:
        """``not reading the text (am) since step 1,200``."""
        lang = f" ({self.language})" if self.language else ""
        since = f" since step {self.since:,}" if self.since is not None else ""
        return f"{self.kind}{lang}{since}"


@dataclass
class Point:
    """One evaluation as the verdicts read it."""

    step: int | None
    readings: dict[str, Reading] = field(default_factory=dict)
    eval_loss: float | None = None


CONFIRM = 2  # a verdict needs this many evaluations in a row: one noisy probe is no finding
README = 'TRAINING_PATCHES_README.md, "Is it learning?"'


def _trailing(series: list[tuple[int, Point]], low: Callable[[Point], bool], warmup: int
              ) -> int | None:
    """The step from which the last evaluations of ``series`` have all been low, when the
    last CONFIRM of them are past the warmup; else None."""
    if len(series) < CONFIRM or series[-CONFIRM][0] < warmup:
        return None
    if not all(low(p) for _, p in series[-CONFIRM:]):
        return None
    start = len(series) - CONFIRM
    while start > 0 and low(series[start - 1][1]):
        start -= 1
    return series[start][1].step


def _watched_loss(points: Sequence[Point]) -> list[float] | None:
    """The loss the no-improvement verdict watches: the trainer's evaluation loss at every
    evaluation, else the probe's own audio loss over the languages measured at every one."""
    if points and all(p.eval_loss is not None and math.isfinite(p.eval_loss) for p in points):
        return [float(p.eval_loss) for p in points]  # type: ignore[arg-type]
    common = set.intersection(*(set(p.readings) for p in points)) if points else set()
    if not common:
        return None
    return [sum(p.readings[lang].own for lang in common) / len(common) for p in points]


def judge(points: Sequence[Point], options: Any | None = None) -> list[Verdict]:
    """The verdicts (:data:`NOT_READING`, :data:`BELOW_BASE`, :data:`NO_IMPROVEMENT`) that
    hold at the last of ``points`` (evaluations in order); their rules: docs/design/learning.md.
    """
    opts = options if options is not None else _options.current()
    warmup, min_gap = int(opts.reading_warmup), float(opts.reading_min_gap)
    if not points:
        return []
    verdicts: list[Verdict] = []
    languages = list(dict.fromkeys(lang for p in points for lang in p.readings))
    latest = len(points) - 1
    # per language: (index among all evaluations, point) of those that measured it
    counted = {language: [(i, p) for i, p in enumerate(points) if language in p.readings
                          and math.isfinite(p.readings[language].gap)] for language in languages}
    first_rel = {language: series[0][1].readings[language].relative
                 for language, series in counted.items() if series}
    for language, series in counted.items():
        if not series or series[-1][0] != latest:
            continue
        first, last = series[0][1].readings[language], series[-1][1].readings[language]
        since = _trailing(series, lambda p: p.readings[language].relative < min_gap, warmup)
        if since is not None:
            fell = last.own < first.own * 0.99
            trend = (f"its audio loss fell from {first.own:.3f} to {last.own:.3f} (the voice "
                     f"is being learned)" if fell else
                     f"its audio loss did not fall either ({first.own:.3f} to {last.own:.3f})")
            verdicts.append(Verdict(NOT_READING, since, (
                f"{trend}, while its own text lowers it by only {last.gap:.3g} "
                f"({last.relative:.2%}, under the {min_gap:.2%} of reading_min_gap; "
                f"{last.share:.0%} of {last.utterances} utterances). Check that the "
                f"transcripts match their audio, that the tokenizer does not turn the script "
                f"into [UNK], that the texts are not cut short (max text length), and that "
                f"the LR is not far too small ({README})"), language))
            continue
        others = {lang: rel for lang, rel in first_rel.items()
                  if lang != language and rel >= 2 * min_gap}
        if not others:
            continue
        base = max(others, key=lambda lang: others[lang])
        bar = float(opts.reading_base_share) * others[base]
        since = _trailing(series, lambda p: p.readings[language].relative < bar, warmup)
        if since is not None:
            verdicts.append(Verdict(BELOW_BASE, since, (
                f"its text lowers its audio loss by {last.relative:.2%}, while {base}'s lowered "
                f"its own by {others[base]:.2%} at the first evaluation (under "
                f"{opts.reading_base_share:.0%} of it: reading_base_share). The model reads "
                f"{language} far less than {base}: check that the texts are not cut short (max "
                f"text length), that the LR is not far too small, that the tokenizer does not "
                f"turn the script into [UNK] ({README})"), language))
    watched = _watched_loss(points)
    patience = int(opts.reading_patience)
    if watched is not None and len(watched) > patience:
        best = min(range(len(watched)), key=lambda i: (watched[i], i))
        if latest - best >= patience:
            name = "evaluation loss" if points[0].eval_loss is not None else "probe's audio loss"
            verdicts.append(Verdict(NO_IMPROVEMENT, points[best].step, (
                f"the {name} has not gone below {watched[best]:.4g} (step "
                f"{points[best].step}) in the {latest - best} evaluations since "
                f"(reading_patience {patience}); the last was {watched[-1]:.4g}. Check the LR "
                f"and the data ({README})")))
    return verdicts


# -- the monitor -------------------------------------------------------------------------------


class LearningMonitor:
    """Measures the reading gap at each evaluation, logs it, records it and warns.

    ``probe`` and ``loss_fn`` are the defaults of :meth:`evaluate`, which a plain loop calls
    where it evaluates; the trainers' integrations call it for you (TRAINING_PATCHES_README.md).
    """

    def __init__(self, probe: ReadingProbe | None = None, loss_fn: LossFn | None = None, *,
                 measured_on: str = AUDIO_LOSS, batch_size: int = 16) -> None:
        self.probe = probe if probe is not None else ReadingProbe()
        self.loss_fn = loss_fn
        self.measured_on = measured_on
        self.batch_size = batch_size
        self.points: list[Point] = []
        self.warned: dict[tuple[str, str | None], int | None] = {}
        self.seconds = 0.0  # spent measuring
        self.skipped = 0  # evaluations left out to keep within reading_budget
        self._last: tuple[float, float] | None = None  # (end, seconds) of the last measurement
        self._announced = False

    def evaluate(self, model: torch.nn.Module, step: int | None = None, *,
                 eval_loss: float | None = None, loss_fn: LossFn | None = None
                 ) -> dict[str, Reading]:
        """Measure, log, record and judge one evaluation at ``step``. ``eval_loss`` is the
        trainer's own evaluation loss, when there is one (else the probe's own loss is the
        one watched for improvement)."""
        fn = loss_fn or self.loss_fn
        if fn is None:
            raise TypeError("LearningMonitor.evaluate needs the model's loss on (text, audio) "
                            "pairs: pass loss_fn= here or to LearningMonitor(...)")
        if not self.probe.languages:
            say_not_measured(f"the probe holds no language with two utterances or more "
                             f"({self.probe.sizes() or 'it is empty'})")
            return {}
        started = time.perf_counter()
        budget = float(_options.current().reading_budget)
        if self._last is not None and self._last[1] > budget * (started - self._last[0]):
            self.skipped += 1
            if self.skipped == 1:
                info("learning: the reading gap took %.1f s at step %s; to keep it under "
                     "%.0f%% of the training time (reading_budget) it is measured again %.0f s "
                     "after that, not at every evaluation", self._last[1], self.points[-1].step
                     if self.points else "?", budget * 100, self._last[1] / budget)
            return {}
        if _sharded(model):
            say_not_measured("the model's parameters are sharded across the ranks (FSDP2 "
                             "DTensors or DeepSpeed ZeRO-3 partitions); the probe runs on one "
                             "rank and cannot run such a model alone")
            return {}
        try:
            readings = self._measure(model, fn)
        except Exception as exc:  # noqa: BLE001 - the probe is never the cause of a lost run
            text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
            logger.warning("learning: the reading gap could not be measured at step %s (%s: "
                           "%s); training goes on without it", step, type(exc).__name__, text)
            say_not_measured(f"the loss function raised {type(exc).__name__}: {text}")
            return {}
        ended = time.perf_counter()
        seconds = ended - started
        self._last = (ended, seconds)
        self.seconds += seconds
        self.observe(readings, step, eval_loss=eval_loss, seconds=seconds)
        return readings

    def _measure(self, model: torch.nn.Module, fn: LossFn) -> dict[str, Reading]:
        """:func:`reading_gap`, in smaller batches after an out-of-memory error (the probe
        runs beside a training run that fills the GPU)."""
        batch = self.batch_size
        while True:
            try:
                return reading_gap(model, self.probe, fn, batch_size=batch,
                                   measured_on=self.measured_on)
            except OOM_ERRORS:
                if batch == 1:
                    raise
                batch = max(1, batch // 2)
                if torch.cuda.is_available() and torch.cuda.is_initialized():
                    torch.cuda.empty_cache()
                info("learning: the reading gap ran out of GPU memory; measured again in "
                     "batches of %d", batch)
                self.batch_size = batch

    def observe(self, readings: Mapping[str, Reading], step: int | None, *,
                eval_loss: float | None = None, seconds: float | None = None) -> list[Verdict]:
        """Log, record and judge readings measured elsewhere; returns the verdicts that hold."""
        opts = _options.current()
        if not self._announced:
            self._announced = True
            record("probe", languages=self.probe.sizes(), measured_on=self.measured_on,
                   thresholds=thresholds(opts))
        for reading in readings.values():
            info("%s", reading.line(step))
            record("reading", step=step, eval_loss=eval_loss, seconds=seconds,
                   **reading.record())
        self.points.append(Point(step, dict(readings), eval_loss))
        verdicts = judge(self.points, opts)
        for verdict in verdicts:
            key = (verdict.kind, verdict.language)
            if key in self.warned:
                continue
            self.warned[key] = verdict.since
            logger.warning("learning: %s: %s", verdict.name(), verdict.detail)
            record("verdict", step=step, kind=verdict.kind, language=verdict.language,
                   since=verdict.since, detail=verdict.detail)
        holding = {(v.kind, v.language) for v in verdicts}
        for key in [k for k in self.warned if k not in holding]:
            del self.warned[key]
            info("learning: %s%s holds no longer at step %s", key[0],
                 f" ({key[1]})" if key[1] else "", step)
            record("cleared", step=step, kind=key[0], language=key[1])
        return verdicts


def checked_monitor(monitor: Any, where: str) -> LearningMonitor:
    """``monitor`` when it is a :class:`LearningMonitor` holding its ``loss_fn``; else a
    TypeError saying what ``where`` needs (before training, not at the first evaluation)."""
    if not isinstance(monitor, LearningMonitor) or monitor.loss_fn is None:
        given = ("a LearningMonitor without loss_fn" if isinstance(monitor, LearningMonitor)
                 else f"{type(monitor).__name__}")
        raise TypeError(
            f"{where} needs a LearningMonitor that holds the model's loss on (text, audio) "
            f"pairs, and was given {given}: the trainer cannot tell the library how to run "
            f"the model on a text and an audio, so build it as LearningMonitor(probe, "
            f"loss_fn) with loss_fn(model, texts, audios) returning one loss per pair (or one "
            f"number for the batch) and probe a ReadingProbe of held-out (text, audio) pairs "
            f"per language ({README})")
    return monitor


def evaluate_once(monitor: LearningMonitor, model: torch.nn.Module, step: int | None, *,
                  eval_loss: float | None = None) -> dict[str, Reading]:
    """``monitor.evaluate`` at a trainer's ``step``, unless that step is measured already
    (several datasets evaluated, or two saves, at one step)."""
    if step is not None and monitor.points and monitor.points[-1].step == step:
        return dict(monitor.points[-1].readings)
    return monitor.evaluate(model, step=step, eval_loss=eval_loss)


def thresholds(options: Any) -> dict[str, Any]:
    """The verdicts' settings as recorded with the probe (``report`` judges with them)."""
    return {name: getattr(options, name) for name in _options.fields_of("learning")}


def record(event: str, **fields: Any) -> str:
    """One record in this rank's ``learning_health.jsonl`` (best effort)."""
    return _run.record_in(_run.report_dir(), _run.LEARNING_FILE, event, **fields)


def say_not_measured(why: str) -> None:
    """Once per reason and run: the reading gap is not measured, and why."""
    if not _run.current().first_time(f"learning.not_measured:{why}"):
        return
    logger.warning("learning: the reading gap is not measured: %s. Nothing tells whether the "
                   "model reads its text; see TRAINING_PATCHES_README.md, \"Is it learning?\"",
                   why)
    record("not_measured", reason=why)


SPEC = register(PatchSpec(
    name="learning",
    describe=lambda o: (f"the reading gap of up to {o.reading_probe} held-out utterances per "
                        f"language at every evaluation (within {o.reading_budget:.0%} of the "
                        f"training time); a WARNING when a language is not read"),
    options=(
        Option("reading_probe", positive_int, 32,
               "a whole number of utterances of at least 2, e.g. 32",
               "held-out utterances per language in the reading probe", low=2, high=4096,
               bound_why="each evaluation runs the model twice over them"),
        Option("reading_budget", share, 0.02,
               "a fraction of the training time above 0 and at most 1, e.g. 0.02",
               "the reading gap is left out at an evaluation that would take it over this share "
               "of the time since the last measurement", low=0, low_open=True, high=1,
               bound_why="a share of the time"),
        Option("reading_warmup", nonnegative_int, 1,
               "a whole number of evaluations of at least 0, e.g. 1",
               "evaluations at the start whose reading gap no verdict counts", low=0,
               high=1_000_000),
        Option("reading_min_gap", share, 0.013,
               "a fraction of the audio loss above 0 and at most 1, e.g. 0.013",
               "a language whose text lowers its audio loss by less than this share is not read",
               low=0, low_open=True, high=1, bound_why="a share of the loss"),
        Option("reading_base_share", share, 0.17,
               "a fraction above 0 and at most 1, e.g. 0.17",
               "a language read under this share of another's first reading is far below it",
               low=0, low_open=True, high=1, bound_why="a share of another language's gap"),
        Option("reading_patience", positive_int, 5, "a whole number of evaluations, e.g. 5",
               "evaluations without a new low of the evaluation loss before saying so", low=1,
               high=1_000_000),
    ),
))

__all__ = ["Reading", "ReadingProbe", "LearningMonitor", "Verdict", "Point", "reading_gap",
           "judge", "record", "say_not_measured", "checked_monitor", "evaluate_once",
           "NOT_READING", "BELOW_BASE", "NO_IMPROVEMENT", "AUDIO_LOSS"]
