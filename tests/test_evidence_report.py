"""``training-patches report`` merges the ranks of a job: the per-rank files written by the
real writer (:func:`patches._run.append_jsonl` as each rank of a launcher runs it), the plain
files of one process, and older records without rank fields. A step skipped on every rank
is one skipped step of the run; who saw the bad value and who only followed a peer is said.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from patches import _run, cli
from patches.tools.report import build, find_runs


EVENTS, SCALE = "nonfinite_events.jsonl", "loss_scale.jsonl"


@pytest.fixture(autouse=True)
def _run_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    _run.set_output_dir(tmp_path)


def write_as(monkeypatch: pytest.MonkeyPatch, rank: int, world: int, name: str,
             records: list[dict[str, Any]]) -> None:
    """Append ``records`` as rank ``rank`` of ``world`` would, through the real writer."""
    with monkeypatch.context() as m:
        m.setenv("RANK", str(rank))
        m.setenv("WORLD_SIZE", str(world))
        for record in records:
            _run.append_jsonl(name, record)


def bad_step(step: int, kind: str = "nonfinite_loss", **extra: Any) -> dict[str, Any]:
    """A skipped step's event as the NaN guard writes it."""
    return {"step": step, "trainer_step": step, "kind": kind, "loss": math.nan,
            "nonfinite_grads": ["text_embedding.weight"], "scale": None,
            "samples": [f"clip_{step}.wav"], "consecutive": 1, **extra}


def peer_step(step: int) -> dict[str, Any]:
    """A rank that skipped only because a peer saw the bad value (contract: no grad list)."""
    return {"step": step, "trainer_step": step, "kind": "peer_nonfinite", "loss": 2.5,
            "scale": None, "samples": [f"fine_{step}.wav"], "consecutive": 1}


def _report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli.main(["report", str(tmp_path), "--out", str(tmp_path / "r.png")])
    return code, capsys.readouterr().out


def test_evidence_rank_0_saw_the_nan_rank_1_followed_one_skip(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    write_as(monkeypatch, 0, 2, EVENTS, [bad_step(3)])
    write_as(monkeypatch, 1, 2, EVENTS, [peer_step(3)])
    assert sorted(p.name for p in tmp_path.glob("*.jsonl")) == [
        "nonfinite_events.rank0.jsonl", "nonfinite_events.rank1.jsonl"]
    code, out = _report(tmp_path, capsys)
    assert code == 1
    assert "skipped steps: 1 (nonfinite_loss 1) at steps 3" in out
    assert "  step 3 (nonfinite_loss): seen on rank 0, followed on rank 1" in out
    assert "  rank 0: saw 1 bad step(s), followed a peer in 0" in out
    assert "  rank 1: saw 0 bad step(s), followed a peer in 1" in out
    assert "verdict: skipped steps" in out and "repeated skips" not in out
    assert "samples seen most in bad batches: clip_3.wav (1)\n" in out  # not rank 1's batch
    report = build(find_runs(str(tmp_path))[0])
    (skip,) = report.facts.skips
    assert (skip.step, skip.kind, skip.seen_on, skip.followed_on) == (
        3, "nonfinite_loss", [0], [1])
    assert skip.loss is not None and math.isnan(skip.loss)  # "NaN" read back as a number


def test_evidence_a_step_every_rank_saw_is_still_one_skip(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    for rank in range(3):
        write_as(monkeypatch, rank, 3, EVENTS, [bad_step(5, "nonfinite_grad")])
    write_as(monkeypatch, 2, 3, EVENTS, [bad_step(9), bad_step(10, consecutive=2)])
    write_as(monkeypatch, 0, 3, EVENTS, [peer_step(9), peer_step(10)])
    write_as(monkeypatch, 1, 3, EVENTS, [peer_step(9), peer_step(10)])
    code, out = _report(tmp_path, capsys)
    assert "skipped steps: 3 (nonfinite_grad 1, nonfinite_loss 2) at steps 5, 9, 10" in out
    assert "  step 5 (nonfinite_grad): seen on ranks 0, 1, 2" in out
    assert "  step 9 (nonfinite_loss): seen on rank 2, followed on ranks 0, 1" in out
    assert "  rank 2: saw 3 bad step(s), followed a peer in 0" in out
    assert "  rank 1: saw 1 bad step(s), followed a peer in 2" in out
    report = build(find_runs(str(tmp_path))[0])
    assert report.facts.longest_streak == 2 and report.headline == "repeated skips"


def test_evidence_plain_files_and_old_records_merge_with_rank_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """A job's rank files beside a single process's plain file of older records (no rank
    field, bare NaN as Python's json wrote it before): all are the run's."""
    (tmp_path / EVENTS).write_text(
        '{"step": 1, "trainer_step": 1, "kind": "nonfinite_loss", "loss": NaN}\n',
        encoding="utf-8")
    (tmp_path / "nonfinite_events.rank1.jsonl").write_text(  # an older writer: no rank field
        json.dumps(peer_step(4)) + "\n", encoding="utf-8")
    write_as(monkeypatch, 0, 2, EVENTS, [bad_step(4)])
    code, out = _report(tmp_path, capsys)
    assert "skipped steps: 2 (nonfinite_loss 2) at steps 1, 4" in out
    assert "  step 1 (nonfinite_loss): seen on rank 0" in out
    assert "  step 4 (nonfinite_loss): seen on rank 0, followed on rank 1" in out
    assert "unreadable" not in out


def test_evidence_a_single_process_run_shows_no_rank_lines(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    _run.append_jsonl(EVENTS, bad_step(2))
    code, out = _report(tmp_path, capsys)
    assert "skipped steps: 1 (nonfinite_loss 1) at steps 2" in out
    assert "ranks:" not in out and "seen on" not in out


def test_evidence_scale_of_every_rank_read_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """Every rank's scaler records the same overflows and backoffs: the run had them once."""
    records = [{"step": 2, "trainer_step": 2, "scale_before": 1024.0, "scale": 512.0,
                "overflow": True, "loss": math.nan},
               {"step": 6, "trainer_step": 6, "scale_before": 512.0, "scale": 256.0,
                "overflow": True, "loss": 3.0}]
    for rank in (0, 1):
        write_as(monkeypatch, rank, 2, SCALE, records)
    f = build(find_runs(str(tmp_path))[0]).facts
    assert [(s.step, s.kind, s.seen_on) for s in f.skips] == [
        (2, "nonfinite_loss", [0, 1]), (6, "overflow", [0, 1])]
    assert f.backoffs == 2 and [v for _, v in f.scale] == [1024.0, 512.0, 256.0]
    assert f.overflows == [2, 6]
    assert {r: (x.overflows) for r, x in f.ranks.items()} == {0: 2, 1: 2}


def test_evidence_ooms_summed_dropped_samples_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from patches import dataset_guard

    sample = {"audio_file": "a.wav", "text": "hi", "language": "en"}
    for rank in (0, 1):
        with monkeypatch.context() as m:
            m.setenv("RANK", str(rank))
            m.setenv("WORLD_SIZE", "2")
            dataset_guard.record_drop(dataset_guard.report_path(),
                                      dataset_guard.sample_key("train", sample),
                                      {"split": "train", "audio_file": "a.wav",
                                       "reason": "decode_failure"})
        write_as(monkeypatch, rank, 2, "oom_events.jsonl",
                 [{"kind": "out_of_memory", "trainer_step": 4 + rank}])
    code, out = _report(tmp_path, capsys)
    assert "dropped samples: 1 (decode_failure 1)" in out
    assert "out-of-memory batches skipped: 2" in out
    assert "  rank 1: saw 0 bad step(s), followed a peer in 0, 1 out-of-memory batches, " \
           "1 dropped samples" in out


def test_evidence_agreed_counters_of_ranks_taken_once(tmp_path: Path) -> None:
    """headless_runs.jsonl with one finishing record per rank: steps/skipped are agreed."""
    from patches.tools.report.verdict import _patch_stats

    ends = [{"event": "finished", "rank": r, "world_size": 2, "patch_stats": {
        "nan_guard": {"steps": 20, "skipped": 1, "nonfinite_losses": 1 - r, "peer_skips": r},
        "oom_guard": {"oom_skipped": 1},
        "grad_scaler": {"enabled": 1, "scale": 512.0, "steps": 20, "skipped": 1},
        "grad_clip": {"calls": 20, "nonfinite_norms": 1}}} for r in (0, 1)]
    (tmp_path / "headless_runs.jsonl").write_text(
        "".join(json.dumps(e) + "\n" for e in ends), encoding="utf-8")
    (tmp_path / EVENTS).write_text("")
    stats = _patch_stats(find_runs(str(tmp_path))[0])
    assert stats["nan_guard"] == {"steps": 20, "skipped": 1, "nonfinite_losses": 1,
                                  "peer_skips": 1}
    assert stats["oom_guard"] == {"oom_skipped": 2}
    assert stats["grad_scaler"] == {"enabled": 1, "scale": 512.0, "steps": 20, "skipped": 1}
    assert stats["grad_clip"] == {"calls": 20, "nonfinite_norms": 1}


def test_evidence_the_cause_names_the_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys) -> None:
    """DDP's all-reduce carries rank 1's NaN loss to rank 0's gradients: the step is a
    non-finite loss (its cause), whichever rank's file is read first."""
    write_as(monkeypatch, 0, 2, EVENTS, [bad_step(7, "nonfinite_grad")])
    write_as(monkeypatch, 1, 2, EVENTS, [bad_step(7, "nonfinite_loss")])
    code, out = _report(tmp_path, capsys)
    assert "skipped steps: 1 (nonfinite_loss 1) at steps 7" in out
    assert "  step 7 (nonfinite_loss): seen on ranks 0, 1" in out
