"""The training-patches command: doctor and report."""

from __future__ import annotations

import json

from patches import cli


def test_doctor_lists_torch_and_exits_zero(capsys) -> None:
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "wrapt" in out and "ffmpeg" in out


def test_report_summarises_events_and_dropped_samples(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # the picture goes to the current folder
    events = [
        {"step": 3, "trainer_step": 2, "kind": "nonfinite_loss", "samples": ["a.wav", "b.wav"],
         "consecutive": 1, "source": {"module": "gpt.text_embedding", "where": "output"}},
        {"step": 9, "trainer_step": 8, "kind": "nonfinite_grad", "samples": ["a.wav", "c.wav"],
         "consecutive": 1},
    ]
    (tmp_path / "nonfinite_events.jsonl").write_text(
        "".join(json.dumps(e) + "\n" for e in events) + "{torn line\n")
    (tmp_path / "dropped_samples.jsonl").write_text(
        json.dumps({"audio_file": "x.wav", "reason": "decode_failure"}) + "\n")
    assert cli.main(["report", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "skipped steps: 2 (nonfinite_loss 1, nonfinite_grad 1)" in out
    assert "a.wav (2)" in out and "gpt.text_embedding" in out
    assert "1 unreadable line(s)" in out
    assert "dropped samples: 1 (decode_failure 1)" in out


def test_report_on_a_missing_folder_is_a_clear_error(tmp_path, capsys) -> None:
    assert cli.main(["report", str(tmp_path / "nope")]) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_version(capsys) -> None:
    import pytest

    import patches

    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"training-patches {patches.__version__}"
