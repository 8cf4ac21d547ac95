"""``headlessXttsTrain.py --demo`` (``make demo``) end to end, in a subprocess, on the CPU:
the summary it prints and writes is read from the run and shows every promise kept."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import forkserver
import pytest
from processes import child_path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "headlessXttsTrain.py"


def _run(*args: str, timeout: int = 400) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=child_path(ROOT))
    return forkserver.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
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
    # the continued run starts at the step the interruption stopped at: 3 epochs of 6 steps
    # are 18 steps trained once each (the checkpoint written on the signal used to continue
    # one step further on)
    assert summary["resumed_at_step"] == summary["interrupted_at_step"]
    assert summary["steps_per_phase"] == [8, 10]
    assert summary["steps_trained"] == summary["final_step"] == 18
    assert summary["dropped_samples"] == 0 and summary["dropped_samples_file"] is None

    # the printed summary carries the same figures, and says where the logs are
    assert "training-patches demo: summary" in result.stdout
    assert re.search(r"skipped steps\s+: 1 in nonfinite_events\.jsonl", result.stdout)
    assert re.search(r"base-row drift\s+: 0\.0 ", result.stdout)
    # the tiny base model does not read its text: row_init auto gave near-zero rows, and said so
    assert summary["new_rows"]["embedding"] == "std0.02"
    assert summary["new_rows"]["auto"]["reads"] is False
    assert re.search(r"new rows\s+: embedding std0\.02, head spread \(row_init auto: the base "
                     r"model does not read its text, text_tv 0\.\d{3} at or below ", result.stdout)
    assert f"steps trained       : {summary['steps_trained']} " in result.stdout
    assert str(out / "finetune" / "train.log") in result.stdout
    assert "[FAILED]" not in result.stdout
    for path in (out / "finetune" / "train.log", Path(summary["logs"]["events"])):
        assert path.is_file()
    import shutil

    shutil.rmtree(out)  # about 1.8 GB of coqui checkpoints: not kept in pytest's tmp folders



def test_second_demo_replaces_only_its_own_folder(tmp_path: Path) -> None:
    """What a second ``make demo`` does first: the files the demo wrote (listed in its
    marker) are removed; a file someone left beside them stays; a file someone left among
    them refuses the run with nothing removed (issue 26: the demo deleted them); any other
    non-empty folder is refused untouched."""
    from demo.xtts_demo import MARKER, DemoError, prepare_folder, record_files

    demo = tmp_path / "demo_output"
    prepare_folder(demo)
    (demo / "finetune").mkdir()
    (demo / "finetune" / "old.pth").write_bytes(b"x")
    record_files(demo)  # as the demo does after each phase
    (demo / "notes.txt").write_text("mine", encoding="utf-8")  # beside the demo's files
    prepare_folder(demo)
    assert sorted(p.name for p in demo.iterdir()) == [MARKER, "notes.txt"]
    assert (demo / "notes.txt").read_text(encoding="utf-8") == "mine"
    (demo / "finetune").mkdir()
    (demo / "finetune" / "old.pth").write_bytes(b"x")
    record_files(demo)
    (demo / "finetune" / "my_best.pth").write_bytes(b"keep")  # among the demo's files
    with pytest.raises(DemoError, match="did not write.*finetune/my_best.pth.*Nothing was "
                                        "removed"):
        prepare_folder(demo)
    assert (demo / "finetune" / "my_best.pth").read_bytes() == b"keep"
    assert (demo / "finetune" / "old.pth").is_file()
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


@pytest.mark.xtts
@pytest.mark.slow
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGKILL"])
def test_the_fine_tune_child_ends_with_the_demo(tmp_path: Path, signame: str) -> None:
    """Issue 26 item 2: SIGTERM to ``--demo`` left its fine-tune child training. The child
    now gets the signal too (SIGTERM to the demo), or SIGTERM when the demo dies outright
    (SIGKILL): it finishes its step, writes a checkpoint and an ``interrupted`` record, and
    exits; the demo exits 143."""
    pytest.importorskip("TTS")
    import signal
    import time

    import shutil

    from processes import alive as _alive
    from processes import default_signals

    out = tmp_path / "demo"
    env = dict(os.environ, PYTHONPATH=child_path(ROOT))
    proc = forkserver.popen([sys.executable, str(SCRIPT), "--demo", "--output-dir", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=ROOT, start_new_session=True,
                            preexec_fn=default_signals)
    runs = out / "finetune" / "headless_runs.jsonl"
    log = out / "finetune" / "train.log"
    child = None
    try:
        deadline = time.monotonic() + 900  # only turns a hang into a failure
        while child is None or "GLOBAL_STEP: 1" not in log.read_text(encoding="utf-8"):
            assert time.monotonic() < deadline and proc.poll() is None, proc.poll()
            time.sleep(0.2)
            if child is None and runs.is_file():
                starts = [json.loads(line) for line in runs.read_text().splitlines()
                          if '"start"' in line]
                child = starts[0]["pid"] if starts else None
        assert _alive(child)
        os.kill(proc.pid, getattr(signal, signame))
        output = proc.communicate(timeout=600)[0]
        while _alive(child):  # the child, reparented after a SIGKILL, ends on its own
            assert time.monotonic() < deadline, "the fine-tune child trains on"
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)
    records = [json.loads(line) for line in runs.read_text(encoding="utf-8").splitlines()]
    last = records[-1]
    text = log.read_text(encoding="utf-8")
    said = [line for line in text.splitlines() if "interrupted by" in line]
    # The orphaned child's death signal can come more than once (per thread of the dying
    # demo), also while its checkpoint is written: no signal cuts that short any more, so
    # its record is there in every case (it used to be lost about 1 run in 8).
    assert last["event"] == "interrupted", (records, said)
    if "--interrupt-after-step" in text and "sending SIGINT" in text:
        # On a slow machine the demo's own interruption after step 8 came with ours: two
        # signals in one step. The child then says so and stops at once (a second signal
        # never waits), writing no checkpoint of a half-done step.
        assert any("a second signal stopped a step half-way" in line for line in said) \
            or last["checkpoint"] is not None, (last, said)
    else:
        assert last["signal"] == "SIGTERM", (last, said)
        # A checkpoint written at the interruption; or, when the signal came right after a
        # periodic save (no step finished since: none is written twice), that save.
        if last["checkpoint"] is not None:
            assert Path(last["checkpoint"]).is_file(), (last, said)
        else:
            assert "no step finished since the last checkpoint" in said[-1], (last, said)
            assert list(Path(last["run_folder"]).glob("checkpoint_*.pth")), last
    if signame == "SIGTERM":
        assert proc.returncode == 143, output[-3000:]
        assert "== demo: interrupted by SIGTERM: the fine-tune run was stopped the same way " \
               "(exit 143" in output and "Traceback" not in output
        assert not (out / "demo_summary.json").exists()
    else:
        assert proc.returncode == -signal.SIGKILL
    shutil.rmtree(out)  # coqui checkpoints: not kept in pytest's tmp folders
