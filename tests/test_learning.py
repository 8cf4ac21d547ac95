"""The reading gap (patches.learning): measured without side effects, judged, logged, recorded.

A real torch model that must read its text to predict its "audio" (each audio code is a
fixed function of the text token at its position) tells a run that reads from one trained
on shuffled pairs, which learns the codes' frequencies (its loss falls) and not the text.
"""

from __future__ import annotations

import json
import logging
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import patches
from patches import learning
from patches.advanced import LearningMonitor, ReadingProbe

VOCAB = 12
LENGTH = 6


class Reader(torch.nn.Module):
    """Predicts each audio code from the text token at its position (a dropout in between)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(VOCAB, 16)
        self.dropout = torch.nn.Dropout(0.1)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, text: torch.Tensor) -> torch.Tensor:
        return self.head(self.dropout(self.embedding(text)))


def audio_loss(model: Reader, texts: list[torch.Tensor], audios: list[torch.Tensor]) -> torch.Tensor:
    """Nats per code of each pair (one per pair)."""
    logits = model(torch.stack(texts))
    return F.cross_entropy(logits.transpose(1, 2), torch.stack(audios), reduction="none").mean(1)


def pairs(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(99))
    texts = [torch.randint(0, VOCAB, (LENGTH,), generator=g) for _ in range(n)]
    return [(t, perm[t]) for t in texts]


def train(model: Reader, data: list[tuple[torch.Tensor, torch.Tensor]], steps: int,
          lr: float = 0.05) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for step in range(steps):
        batch = data[(step * 16) % len(data):][:16]
        loss = audio_loss(model, [t for t, _ in batch], [a for _, a in batch]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def shuffled(data: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    texts = [t for t, _ in data]
    random.Random(3).shuffle(texts)
    return list(zip(texts, [a for _, a in data]))


@pytest.fixture
def run_dir(tmp_path):
    patches.advanced.reset_runtime_state()
    patches.advanced.set_output_dir(tmp_path)
    yield tmp_path
    patches.advanced.set_output_dir(None)
    patches.advanced.reset_runtime_state()


def records(folder) -> list[dict]:
    path = folder / "learning_health.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# -- the measurement --------------------------------------------------------------------------


def test_a_model_that_reads_has_a_gap_and_an_untrained_one_none() -> None:
    torch.manual_seed(0)
    probe = learning.ReadingProbe({"xx": pairs(32, 1)})
    fresh = Reader()
    assert abs(learning.reading_gap(fresh, probe, audio_loss)["xx"].gap) < 0.1
    trained = Reader()
    train(trained, pairs(256, 2), 150)
    reading = learning.reading_gap(trained, probe, audio_loss)["xx"]
    assert reading.gap > 1.0 and reading.share == 1.0
    assert reading.own < 0.5 and reading.utterances == 32


def test_the_gap_comes_with_its_standard_error_over_the_utterances() -> None:
    """Each utterance's gap is known here (its own text costs 1, another's 1 + its delta):
    the standard error is their sample std / sqrt(n), and the log line gives it."""
    deltas = [0.1, 0.3, 0.2, 0.6, 0.4, 0.0]
    data = [(torch.tensor([i]), torch.tensor([i])) for i in range(len(deltas))]

    def loss(model, texts, audios):
        return torch.tensor([1.0 if int(t) == int(a) else 1.0 + deltas[int(a)]
                             for t, a in zip(texts, audios)], dtype=torch.float64)

    reading = learning.reading_gap(Reader(), learning.ReadingProbe({"xx": data}), loss)["xx"]
    assert reading.gap == pytest.approx(np.mean(deltas))
    assert reading.stderr == pytest.approx(np.std(deltas, ddof=1) / np.sqrt(len(deltas)))
    assert f"gap {reading.gap:.3g} ± {reading.stderr:.2g} nats/code" in reading.line(10)
    assert reading.gaps == pytest.approx(deltas)  # in the probe's order
    assert reading.record()["stderr"] == reading.stderr and "gaps" not in reading.record()
    unknown = learning.Reading("xx", 1, 1.0, 1.5, 1.0)  # a record from before the figure
    assert np.isnan(unknown.stderr) and "gap 0.5 nats/code" in unknown.line(10)


def test_the_measurement_leaves_rng_modes_and_gradients_as_they_were() -> None:
    model = Reader()
    model.train()
    model.head.eval()  # mixed modes, as XTTS's GPTTrainer keeps them
    probe = learning.ReadingProbe({"xx": pairs(8, 1)})

    def noisy(m, texts, audios):  # draws from every generator the run might use
        random.random()
        np.random.rand()
        return audio_loss(m, texts, audios) + torch.rand(len(texts))
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    learning.reading_gap(model, probe, noisy)
    assert torch.equal(torch.rand(3), expected[0])
    assert random.random() == expected[1] and np.random.rand() == expected[2]
    assert model.training and model.embedding.training and not model.head.training
    assert all(p.grad is None for p in model.parameters())

    def broken(m, texts, audios):
        raise RuntimeError("the loss failed")
    torch.manual_seed(5)
    with pytest.raises(RuntimeError, match="the loss failed"):
        learning.reading_gap(model, learning.ReadingProbe({"xx": pairs(8, 1)}), broken)
    assert torch.equal(torch.rand(3), expected[0])
    assert model.training and not model.head.training


def test_own_and_other_text_are_compared_on_the_same_random_draws() -> None:
    """A stochastic loss (F5-TTS's flow matching draws its time and noise) is paired: the
    noise cancels, the gap is the loss's own difference to the last digit."""
    model = Reader()
    probe = learning.ReadingProbe({"xx": pairs(8, 1)})

    def with_noise(m, texts, audios):
        return audio_loss(m, texts, audios) + 5 * torch.randn(len(texts))
    exact = learning.reading_gap(model, probe, audio_loss)["xx"]
    noisy = learning.reading_gap(model, learning.ReadingProbe({"xx": pairs(8, 1)}), with_noise)["xx"]
    assert noisy.gap == pytest.approx(exact.gap, abs=1e-5)


@pytest.mark.parametrize("n", [2, 3, 7, 32])
def test_each_utterance_gets_another_text_of_about_its_length(n: int) -> None:
    texts = [list(range(length)) for length in random.Random(n).choices(range(1, 40), k=n)]
    partner = learning.partners(texts)
    assert all(partner[i] != i for i in range(n))
    assert sorted(partner) == list(range(n))  # every text is given once
    by_length = sorted(range(n), key=lambda i: (len(texts[i]), i))
    rank = {i: r for r, i in enumerate(by_length)}
    assert all(abs(rank[i] - rank[partner[i]]) <= 2 for i in range(n))


def test_a_tokenizer_that_keeps_only_the_length_is_not_read() -> None:
    """Texts of [UNK]s: their length tells the audio's, their content nothing. With the
    lengths matched, a model that reads only the length has no gap."""
    torch.manual_seed(0)

    class LengthReader(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = torch.nn.Linear(1, 4)

        def forward(self, text):
            return self.head(torch.full((1,), float(len(text))))

    def loss(m, texts, audios):  # the audio's "code" is its length
        return torch.stack([F.cross_entropy(m(t)[None], a[None]) for t, a in zip(texts, audios)])
    data = [([1] * k, torch.tensor(k % 4)) for k in (1, 1, 2, 2, 3, 3, 4, 4)]
    model = LengthReader()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(300):
        opt.zero_grad()
        loss(model, [t for t, _ in data], [a for _, a in data]).mean().backward()
        opt.step()
    assert learning.reading_gap(model, learning.ReadingProbe({"xx": data}), loss)["xx"].gap \
        == pytest.approx(0, abs=1e-6)


def test_a_batch_mean_is_measured_one_pair_at_a_time_and_a_wrong_count_refused() -> None:
    model = Reader()
    calls = []

    def batch_mean(m, texts, audios):
        calls.append(len(texts))
        return audio_loss(m, texts, audios).mean()
    per_pair = learning.reading_gap(model, learning.ReadingProbe({"xx": pairs(6, 1)}), audio_loss)
    mean = learning.reading_gap(model, learning.ReadingProbe({"xx": pairs(6, 1)}), batch_mean)
    assert mean["xx"].gap == pytest.approx(per_pair["xx"].gap, abs=1e-5)
    assert calls.count(1) == 12  # each pair with its own text and another's

    with pytest.raises(ValueError, match="returned 2 losses for 6 pairs"):
        learning.reading_gap(model, learning.ReadingProbe({"xx": pairs(6, 1)}),
                             lambda m, t, a: torch.zeros(2))


def test_the_probe_is_chosen_once_and_kept() -> None:
    probe = learning.ReadingProbe(per_language=3)
    kept = [probe.add("am", t, a) for t, a in pairs(5, 1)]
    assert kept == [True, True, True, False, False] and probe.sizes() == {"am": 3}
    probe.add("en", *pairs(1, 2)[0])
    assert probe.languages == ["am"]  # one utterance has no other text to be given
    learning.reading_gap(Reader(), probe, audio_loss)
    assert probe.frozen and not probe.add("en", *pairs(1, 3)[0])


# -- verdicts ---------------------------------------------------------------------------------


def point(step: int, **gaps: tuple[float, float]) -> learning.Point:
    """``lang=(own loss, gap)``."""
    return learning.Point(step, {lang: learning.Reading(lang, 32, own, own + gap, 0.5)
                                 for lang, (own, gap) in gaps.items()})


def test_not_reading_needs_two_evaluations_past_the_warmup() -> None:
    opts = patches._options.Options(reading_warmup=1, reading_min_gap=0.01)
    low = [point(s, am=(4.0 - s / 100, 0.001)) for s in (0, 100, 200, 300)]
    assert learning.judge(low[:2], opts) == []  # the first is the warmup, one alone is noise
    (verdict,) = learning.judge(low[:3], opts)
    assert verdict.kind == learning.NOT_READING and verdict.language == "am"
    assert verdict.since == 0 and verdict.name() == "not reading the text (am) since step 0"
    assert "its audio loss fell from 4.000 to 2.000" in verdict.detail
    read = low[:3] + [point(300, am=(1.0, 0.1))]
    assert learning.judge(read, opts) == []


def test_far_below_the_base_language_and_no_improvement() -> None:
    opts = patches._options.Options(reading_warmup=0, reading_min_gap=0.01,
                                     reading_base_share=0.25, reading_patience=2)
    points = [point(s, am=(3.0, 0.06), en=(2.0, 0.4)) for s in (0, 100, 200)]
    kinds = {(v.kind, v.language, v.since) for v in learning.judge(points, opts)}
    # am's 2% is under a quarter of en's 20% at its first evaluation; no loss went down
    assert kinds == {(learning.BELOW_BASE, "am", 0), (learning.NO_IMPROVEMENT, None, 0)}
    points[2].eval_loss = points[1].eval_loss = points[0].eval_loss = 5.0
    points[2].eval_loss = 4.0
    assert {v.kind for v in learning.judge(points, opts)} == {learning.BELOW_BASE}


# -- the monitor in a training run ------------------------------------------------------------


def monitored_run(data, probe, steps: int = 120, every: int = 20) -> learning.LearningMonitor:
    torch.manual_seed(0)
    model = Reader()
    monitor = LearningMonitor(ReadingProbe({"xx": probe}), audio_loss)
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    monitor.evaluate(model, step=0)
    for step in range(1, steps + 1):
        batch = data[(step * 16) % len(data):][:16]
        loss = audio_loss(model, [t for t, _ in batch], [a for _, a in batch]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % every == 0:
            monitor.evaluate(model, step=step)
    return monitor


def test_a_run_on_shuffled_transcripts_is_named_and_a_healthy_one_is_not(run_dir, caplog) -> None:
    """The held-out probe comes from the same manifest as the training pairs: shuffled too.
    The toy's loss is about 2.5 nats, its noise about 2% of it: the threshold says so."""
    patches.advanced.apply(["learning"], reading_min_gap=0.05, reading_budget=1.0)
    caplog.set_level(logging.INFO, logger="training_patches")
    monitored_run(pairs(256, 2), pairs(32, 7))
    assert "learning:" not in "".join(r.getMessage() for r in caplog.records
                                      if r.levelno >= logging.WARNING)
    assert "reading xx at step 120: gap" in caplog.text
    caplog.clear()
    (run_dir / "learning_health.jsonl").unlink()
    monitored_run(shuffled(pairs(256, 2)), shuffled(pairs(32, 7)))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings  # said once, not at every evaluation
    assert warnings[0].startswith("learning: not reading the text (xx) since step 0: its "
                                  "audio loss fell from")
    events = records(run_dir)
    assert [e["event"] for e in events].count("reading") == 7
    assert events[0]["event"] == "probe" and events[0]["languages"] == {"xx": 32}
    (verdict,) = [e for e in events if e["event"] == "verdict"]
    assert verdict["kind"] == learning.NOT_READING and verdict["since"] == 0
    assert verdict["step"] == 40  # warmup 1, then two evaluations in a row


def test_a_monitor_without_a_loss_or_a_probe_says_so(run_dir, caplog) -> None:
    with pytest.raises(TypeError, match="needs the model's loss"):
        LearningMonitor().evaluate(Reader(), step=1)
    monitor = LearningMonitor(ReadingProbe({"xx": pairs(1, 1)}), audio_loss)
    assert monitor.evaluate(Reader(), step=1) == {}
    assert monitor.evaluate(Reader(), step=2) == {}
    assert caplog.text.count("the reading gap is not measured") == 1
    assert [e["event"] for e in records(run_dir)] == ["not_measured"]


def test_the_measurement_keeps_within_its_share_of_the_training_time(run_dir, caplog,
                                                                     monkeypatch) -> None:
    """An evaluation that comes sooner than the last measurement's time / reading_budget is
    left out (said once); the first evaluation is always measured."""
    patches.advanced.apply(["learning"], reading_budget=0.5)
    caplog.set_level(logging.INFO, logger="training_patches")
    clock = [100.0]
    monkeypatch.setattr(learning.time, "perf_counter", lambda: clock[0])

    def slow_loss(m, texts, audios):
        clock[0] += 1.0  # each call "takes" a second: 4 calls, 4 s a measurement
        return audio_loss(m, texts, audios)
    monitor = LearningMonitor(ReadingProbe({"xx": pairs(32, 7)}), slow_loss)
    model = Reader()
    measured = []
    for step in range(6):
        clock[0] += 3.0  # 3 s of training between evaluations: under 4 s / 0.5
        if monitor.evaluate(model, step=step):
            measured.append(step)
    assert measured == [0, 3]  # 8 s after the first ended: 9 s, then 12 s later ...
    assert monitor.skipped == 4 and monitor.seconds == 8.0
    assert caplog.text.count("to keep it under 50% of the training time") == 1
    assert [r["step"] for r in records(run_dir) if r["event"] == "reading"] == [0, 3]


def test_a_failing_loss_never_ends_the_run_and_a_full_gpu_halves_the_batch(run_dir, caplog) -> None:
    model = Reader()

    def broken(m, texts, audios):
        raise KeyError("cond_mels")
    monitor = LearningMonitor(ReadingProbe({"xx": pairs(8, 1)}), broken)
    assert monitor.evaluate(model, step=5) == {} and monitor.evaluate(model, step=6) == {}
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert said[0].startswith("learning: the reading gap could not be measured at step 5 "
                              "(KeyError: 'cond_mels'); training goes on without it")
    assert sum("the reading gap is not measured" in m for m in said) == 1
    assert [e["reason"] for e in records(run_dir)] == ["the loss function raised KeyError: "
                                                       "'cond_mels'"]

    sizes = []

    def small_gpu(m, texts, audios):
        sizes.append(len(texts))
        if len(texts) > 4:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return audio_loss(m, texts, audios)
    monitor = LearningMonitor(ReadingProbe({"xx": pairs(32, 1)}), small_gpu)
    assert monitor.evaluate(model, step=7)["xx"].utterances == 32
    assert sizes[:2] == [16, 8] and set(sizes[2:]) == {4} and monitor.batch_size == 4


def test_a_pair_refused_by_the_fixed_probe_adds_no_language_to_its_record(run_dir) -> None:
    """The first evaluation raised but fixed the probe; the loop still offers pairs of
    another language: refused, they leave no empty language in the probe or its record."""
    model = Reader()

    def broken(m, texts, audios):
        raise KeyError("cond_mels")
    monitor = LearningMonitor(ReadingProbe({"xx": pairs(8, 1)}), audio_loss)
    assert monitor.evaluate(model, step=5, loss_fn=broken) == {} and monitor.probe.frozen
    assert not monitor.probe.add("yy", *pairs(1, 2)[0])
    assert monitor.probe.sizes() == {"xx": 8}
    assert monitor.evaluate(model, step=6)["xx"].utterances == 8
    (probe,) = [e for e in records(run_dir) if e["event"] == "probe"]
    assert probe["languages"] == {"xx": 8}


def test_a_sharded_model_is_said_not_measured(run_dir, caplog) -> None:
    model = Reader()
    model.head.weight.ds_id = 3  # what DeepSpeed ZeRO-3 marks its partitioned parameters with
    monitor = LearningMonitor(ReadingProbe({"xx": pairs(8, 1)}), audio_loss)
    assert monitor.evaluate(model, step=1) == {}
    assert "parameters are sharded across the ranks" in caplog.text
