"""``training-patches report`` reads ``learning_health.jsonl``: the reading gap per language,
the live monitor's verdicts and the resume checks (patches.learning, patches.resume_check).

A verdict the monitor gave and never cleared is a finding named with its step; one that
cleared is told in the text only; a resume whose LR or optimizer state does not fit is a
finding; a run that measured no reading gap says its learning was not checked, never that
it is healthy. The records are written as the patches write them (event, run_id, rank,
world_size; strict JSON, "NaN" as a string)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from patches.tools import cli
from patches.tools.report import build, find_runs
from patches.tools.report.plotting import READING, save

LEARNING = "learning_health.jsonl"
THRESHOLDS = {"reading_probe": 32, "reading_warmup": 1, "reading_min_gap": 0.004,
              "reading_base_share": 0.25, "reading_patience": 5}
NOT_READING = "not reading the text"


@pytest.fixture(autouse=True)
def _scratch_cwd(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))  # pictures never land in the checkout


def _record(event: str, *, rank: int = 0, world_size: int = 1, run_id: str = "run-a",
            **fields: Any) -> dict[str, Any]:
    return {"event": event, "time": "2026-05-01T10:00:00", "pid": 4242, "cwd": "/work",
            "run_id": run_id, "rank": rank, "world_size": world_size, **fields}


def _reading(step: int, language: str, own: float, rotated: float, share: float,
             **extra: Any) -> dict[str, Any]:
    gap = rotated - own
    return _record("reading", step=step, eval_loss=own, seconds=0.8, language=language,
                   utterances=32, own=own, rotated=rotated, share=share,
                   measured_on="audio loss", gap=gap, relative=gap / own, **extra)


def _probe(**extra: Any) -> dict[str, Any]:
    return _record("probe", languages={"am": 32, "en": 32}, measured_on="audio loss",
                   thresholds=THRESHOLDS, **extra)


def _evaluations(steps: tuple[int, ...] = (200, 400, 600)) -> list[dict[str, Any]]:
    """English read throughout; Amharic's own text lowers its loss by about 0.1%."""
    records = [_probe()]
    for i, step in enumerate(steps):
        records += [_reading(step, "en", 3.0 - 0.1 * i, 3.4 - 0.1 * i, 0.94),
                    _reading(step, "am", 3.5 - 0.1 * i, 3.5 - 0.1 * i + 0.004, 0.5)]
    return records


def _not_reading(step: int = 600, since: int = 400) -> dict[str, Any]:
    return _record("verdict", step=step, kind=NOT_READING, language="am", since=since,
                   detail="its audio loss fell from 3.500 to 3.300 (the voice is being "
                          "learned), while its own text lowers it by only 0.004")


def _write(path: Path, records: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, allow_nan=False) + "\n" for r in records),
                    encoding="utf-8")
    return path


def _text(folder: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli.main(["report", str(folder), "--no-picture"])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured.out


def _strict(text: str) -> dict[str, Any]:
    def refuse(name: str) -> object:
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def _json(folder: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    code = cli.main(["report", str(folder), "--no-picture", "--json", "-"])
    data = _strict(capsys.readouterr().out)
    assert data["exit_code"] == code
    return code, data["runs"][-1]


def test_a_live_not_reading_verdict_is_a_finding_with_its_step(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write(tmp_path / LEARNING, _evaluations() + [_not_reading(step=600, since=400)])
    code, text = _text(tmp_path, capsys)
    assert code == 1 and "health: needs a look" in text
    assert "verdict: not reading the text (am) since step 400" in text
    assert ("  - not reading the text (am) since step 400: its audio loss fell from 3.500 "
            "to 3.300") in text
    assert "the live monitor warned at step 600" in text
    assert "learning am: gap 0.004 nats/code (0.12% of the audio loss), own text lower for " \
           "50% of 32 utterances, at step 600 (3 evaluation(s))" in text
    assert "learning en: gap 0.4 nats/code" in text
    code, run = _json(tmp_path, capsys)
    assert [x["name"] for x in run["findings"]] == ["not reading the text (am) since step 400"]
    assert run["learning"]["checked"] is True
    assert [p["step"] for p in run["learning"]["readings"]["am"]] == [200, 400, 600]
    (verdict,) = run["learning"]["verdicts"]
    assert verdict["holds"] is True and verdict["since"] == 400 and verdict["warned_at"] == 600


def test_a_verdict_cleared_later_is_no_finding_and_the_text_says_so(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    records = _evaluations() + [_not_reading(step=600, since=400),
                                _reading(800, "en", 2.7, 3.1, 0.94),
                                _reading(800, "am", 3.2, 3.4, 0.81),
                                _record("cleared", step=800, kind=NOT_READING, language="am")]
    _write(tmp_path / LEARNING, records)
    code, text = _text(tmp_path, capsys)
    assert code == 0 and "verdict: healthy" in text
    assert "learning: not reading the text (am) from step 400 to step 800, then read" in text
    assert "since step" not in text
    code, run = _json(tmp_path, capsys)
    assert run["findings"] == []
    (verdict,) = run["learning"]["verdicts"]
    assert verdict["holds"] is False and verdict["ended"] == "cleared"
    assert verdict["ended_at"] == 800


@pytest.mark.parametrize("fields, name", [
    ({"step": 26001, "optimizer_steps": 0, "problems": ["fresh_optimizer"],
      "details": ["at step 26,001 the scheduler continues an old schedule (its step 26,000, "
                  "LR 4.78e-05), but the optimizer is fresh"]},
     "LR discontinuity at resume (step 26001)"),
    ({"step": None, "optimizer_steps": 4000, "problems": ["moments"],
      "details": ["the optimizer's state does not fit its parameters (1 tensor(s))"]},
     "optimizer state does not fit at resume (step 4000)"),
])
def test_a_resume_that_does_not_fit_is_a_finding(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], fields: dict[str, Any],
        name: str) -> None:
    _write(tmp_path / LEARNING, [_record(
        "resume", scheduler_steps=26000, lr=[4.78e-05], scheduler_lr=[4.78e-05],
        planned_lr=None, schedulers=1, **fields)])
    code, text = _text(tmp_path, capsys)
    assert code == 1 and f"verdict: {name}" in text
    assert f"  - {name}: {fields['details'][0]}" in text
    code, run = _json(tmp_path, capsys)
    assert [x["name"] for x in run["findings"]] == [name]
    assert run["resume_checks"][0]["problems"] == fields["problems"]


def test_a_consistent_resume_is_no_finding(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    _write(tmp_path / LEARNING, _evaluations() + [_record(
        "resume", step=26001, optimizer_steps=26000, scheduler_steps=26000, lr=[4.78e-05],
        scheduler_lr=[4.78e-05], planned_lr=[4.78e-05], problems=[], details=[],
        schedulers=1)])
    code, text = _text(tmp_path, capsys)
    assert code == 0 and "verdict: healthy" in text
    assert ("resume at step 26001: consistent (LR 4.78e-05, the scheduler's 4.78e-05; "
            "optimizer steps 26000, scheduler steps 26000)") in text
    code, run = _json(tmp_path, capsys)
    assert run["findings"] == [] and run["resume_checks"][0]["at"] == 26001


@pytest.mark.parametrize("how", ["not_measured", "no_file"])
def test_no_reading_means_learning_not_checked(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str) -> None:
    """The run's stability is judged as before (exit 0 here), but its learning is said to be
    unchecked, on its own line, with the recorded reason."""
    reason = "the probe holds no language with two utterances or more ({'am': 1})"
    if how == "not_measured":
        _write(tmp_path / LEARNING, [_record("not_measured", reason=reason)])
    else:  # a clean run: one scale growth, nothing skipped, no learning_health.jsonl
        _write(tmp_path / "loss_scale.jsonl", [{"step": 100, "trainer_step": 99,
                                                "scale_before": 1024.0, "scale": 2048.0,
                                                "overflow": False}])
    code, text = _text(tmp_path, capsys)
    assert code == 0
    (line,) = [x for x in text.splitlines() if x.startswith("learning")]
    assert line.startswith("learning: not checked (no reading gap measured: ")
    assert (reason if how == "not_measured" else "no learning_health.jsonl") in line
    assert not [x for x in text.splitlines() if "learning" in x and "healthy" in x]
    code, run = _json(tmp_path, capsys)
    assert run["learning"]["checked"] is False and run["learning"]["readings"] == {}
    assert run["learning"]["not_measured"] == ([reason] if how == "not_measured" else [])


def test_rank_files_are_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A job of two ranks: rank 0 checked its resume, rank 1 measured and warned."""
    _write(tmp_path / LEARNING, [_record(
        "resume", world_size=2, step=26001, optimizer_steps=26000, scheduler_steps=26000,
        lr=[1e-4], scheduler_lr=[1e-4], planned_lr=None, problems=[], details=[],
        schedulers=1)])
    ranked = [{**r, "rank": 1, "world_size": 2} for r in _evaluations() + [_not_reading()]]
    for record in ranked[:3]:  # an older writer left the rank out: the file name says it
        del record["rank"]
    _write(tmp_path / "learning_health.rank1.jsonl", ranked)
    code, text = _text(tmp_path, capsys)
    assert code == 1 and "verdict: not reading the text (am) since step 400" in text
    assert "the live monitor warned at step 600, on rank 1," in text
    assert "resume at step 26001: consistent" in text and "ranks: 2 (0, 1)" in text
    code, run = _json(tmp_path, capsys)
    assert {p["rank"] for p in run["learning"]["readings"]["am"]} == {1}
    assert run["resume_checks"][0]["ranks"] == [0]
    assert sorted(Path(p).name for p in run["records"][LEARNING]) == [
        "learning_health.jsonl", "learning_health.rank1.jsonl"]


def test_a_nan_reading_is_read_as_nan(tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A NaN loss on the probe (a bad batch at evaluation) is written as the string "NaN"."""
    records = _evaluations((200,)) + [_record(
        "reading", step=400, eval_loss="NaN", seconds=0.8, language="am", utterances=32,
        own="NaN", rotated=3.4, share=0.0, measured_on="audio loss", gap="NaN",
        relative="NaN")]
    _write(tmp_path / LEARNING, records)
    code, text = _text(tmp_path, capsys)
    assert code == 0
    assert ("learning am: gap NaN nats/code (NaN of the audio loss), own text lower for 0% "
            "of 32 utterances, at step 400 (2 evaluation(s))") in text
    code, run = _json(tmp_path, capsys)
    last = run["learning"]["readings"]["am"][-1]
    assert last["gap"] == "NaN" and last["own"] == "NaN" and last["rotated"] == 3.4


@pytest.mark.parametrize("with_readings", [True, False])
def test_the_page_draws_the_reading_gap(tmp_path: Path, with_readings: bool) -> None:
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    if with_readings:
        _write(run / LEARNING, _evaluations() + [_not_reading(step=600, since=400)])
    else:
        _write(run / LEARNING, [_record("not_measured", reason="no evaluation batches")])
    (found,) = find_runs(str(run))
    fig = build(found).figure()
    (ax,) = [a for a in fig.axes if a.get_title() == READING]
    if with_readings:
        lines = {line.get_label(): line for line in ax.lines}
        assert {"am", "en"} <= set(lines)
        assert list(lines["am"].get_xdata()) == [200, 400, 600]
        assert lines["am"].get_ydata()[0] == pytest.approx(100 * 0.004 / 3.5)
        mark = lines["not reading the text (am): since 400"]
        assert list(mark.get_xdata()) == [400, 400]
        assert not ax.texts
    else:
        text = " ".join(t.get_text().replace("\n", " ") for t in ax.texts)
        assert text.startswith("learning not checked (no reading gap measured)")
        assert "no evaluation batches" in text and not ax.lines
    png = tmp_path / "page.png"
    save(fig, str(png))
    assert png.stat().st_size > 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_resumed_run_that_no_longer_warns_ends_the_verdict(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The resumed process's monitor starts afresh and clears only what it warned itself:
    three evaluations after the resume (reading_warmup 1, two in a row) without the verdict
    end it; with fewer it still holds."""
    resumed = [{**r, "run_id": "run-b"} for r in _evaluations((800, 1000, 1200))[1:]
               if r["language"] == "en"]
    resumed += [{**_reading(step, "am", 3.0, 3.3, 0.9), "run_id": "run-b"}
                for step in (800, 1000, 1200)]
    _write(tmp_path / LEARNING, _evaluations() + [_not_reading()] + resumed)
    code, text = _text(tmp_path, capsys)
    assert code == 0 and "verdict: healthy" in text
    assert ("learning: not reading the text (am) from step 400; not found again after the "
            "resume (readings from step 800 on)") in text
    _write(tmp_path / LEARNING, _evaluations() + [_not_reading()] + resumed[:4])
    code, text = _text(tmp_path, capsys)
    assert code == 1 and "verdict: not reading the text (am) since step 400" in text


def test_the_gap_is_reported_with_its_standard_error_where_recorded(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    records = [_probe(), _reading(200, "en", 3.0, 3.4, 0.94, stderr=0.031),
               _reading(200, "am", 3.5, 3.504, 0.5)]  # a record written before the figure
    _write(tmp_path / LEARNING, records)
    _, text = _text(tmp_path, capsys)
    assert "learning en: gap 0.4 ± 0.031 nats/code (13.33% of the audio loss)" in text
    assert "learning am: gap 0.004 nats/code (0.11% of the audio loss)" in text
    _, run = _json(tmp_path, capsys)
    assert run["learning"]["readings"]["en"][-1]["stderr"] == 0.031
    assert run["learning"]["readings"]["am"][-1]["stderr"] is None
