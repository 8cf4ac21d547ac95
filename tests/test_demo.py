"""``headlessXttsTrain.py --demo`` (``make demo``) end to end, in a subprocess, on the CPU:
the summary it prints and writes is read from the run and shows every promise kept."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "headlessXttsTrain.py"


def _run(*args: str, timeout: int = 400) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)


@pytest.mark.xtts
@pytest.mark.slow
def test_demo_end_to_end(tmp_path: Path) -> None:
    pytest.importorskip("TTS")
    out = tmp_path / "demo"
    result = _run("--demo", "--output-dir", str(out))
    text = result.stdout + result.stderr
    assert result.returncode == 0, text[-4000:]

    summary = json.loads((out / "demo_summary.json").read_text(encoding="utf-8"))
    assert summary["ok"] is True
    assert [p["exit_code"] for p in summary["phases"]] == [130, 0]
    # finite losses, exactly the injected NaN skipped (events file and patches.stats agree)
    assert summary["losses_logged"] > 0 and summary["losses_finite"] is True
    assert summary["skipped_steps"] == 1 and summary["skipped_steps_stats"] == 1
    assert summary["skipped"][0]["trainer_step"] == 3
    # base rows bit-identical in every checkpoint; all base rows kept by the loader
    assert summary["base_row_drift"] == 0.0
    assert summary["base_row_drift_per_checkpoint"]
    assert set(summary["base_row_drift_per_checkpoint"].values()) == {0.0}
    assert summary["new_rows_moved"] > 0.0  # the new (Amharic) rows did train
    base_rows = summary["base_rows"]
    assert base_rows == summary["vocab"]["base"]
    assert len(summary["kept_rows"]) == 3
    assert all(kept == base_rows for kept in summary["kept_rows"].values())
    # checkpoints, interruption and --resume auto
    assert len(summary["checkpoints_written"]) >= 1 and summary["checkpoints_on_disk"]
    assert summary["interrupted_at_step"] == 8
    assert summary["resumed_from"] == summary["interrupt_checkpoint"]
    assert summary["resumed_at_step"] > summary["interrupted_at_step"]
    assert summary["final_step"] > summary["resumed_at_step"]
    assert summary["steps_trained"] == sum(summary["steps_per_phase"]) > 0
    assert summary["dropped_samples"] == 0 and summary["dropped_samples_file"] is None

    # the printed summary carries the same figures, and says where the logs are
    assert "training-patches demo: summary" in result.stdout
    assert re.search(r"skipped steps\s+: 1 in nonfinite_events\.jsonl", result.stdout)
    assert re.search(r"base-row drift\s+: 0\.0 ", result.stdout)
    assert f"steps trained       : {summary['steps_trained']} " in result.stdout
    assert str(out / "finetune" / "train.log") in result.stdout
    assert "[FAILED]" not in result.stdout
    for path in (out / "finetune" / "train.log", Path(summary["logs"]["events"])):
        assert path.is_file()
    import shutil

    shutil.rmtree(out)  # about 1.8 GB of coqui checkpoints: not kept in pytest's tmp folders



def test_second_demo_replaces_only_its_own_folder(tmp_path: Path) -> None:
    """What a second ``make demo`` does first: a folder with the demo's marker is emptied,
    any other non-empty folder is refused untouched."""
    from demo.xtts_demo import MARKER, DemoError, prepare_folder

    demo = tmp_path / "demo_output"
    prepare_folder(demo)
    (demo / "finetune").mkdir()
    (demo / "finetune" / "old.pth").write_bytes(b"x")
    prepare_folder(demo)
    assert sorted(p.name for p in demo.iterdir()) == [MARKER]
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("keep", encoding="utf-8")
    with pytest.raises(DemoError, match="was not made by the demo"):
        prepare_folder(other)
    assert (other / "keep.txt").is_file()


@pytest.mark.xtts
def test_demo_refuses_a_folder_it_did_not_make(tmp_path: Path) -> None:
    pytest.importorskip("TTS")
    (tmp_path / "mine.txt").write_text("keep me", encoding="utf-8")
    result = _run("--demo", "--output-dir", str(tmp_path), timeout=120)
    assert result.returncode == 2
    assert "was not made by the demo" in result.stderr and "Traceback" not in result.stderr
    assert (tmp_path / "mine.txt").read_text(encoding="utf-8") == "keep me"


@pytest.mark.slow
def test_demo_takes_no_base_files(tmp_path: Path) -> None:
    result = _run("--demo", "--base-dir", str(tmp_path), timeout=120)
    assert result.returncode == 2
    assert "--base-dir" in result.stderr and "Traceback" not in result.stderr
