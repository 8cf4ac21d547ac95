"""One run, one folder (issue 26 item 3): two runs into one output folder never share a run
folder, a run folder in use is never continued by a second process, and ``report`` tells
the runs apart.

Reproduced before the fix: two headless runs into one ``--output-dir`` started in the same
minute both exited 0 in one coqui run folder (its name has the minute only), one run's
``checkpoint_6.pth`` and ``config.json`` replaced, its best model deleted, and ``report``
showed a single healthy run."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator

import forkserver
import pytest

from patches import RunFolderInUse
from patches._runlock import LOCK_NAME, claim_new_folder, lock_folder

from processes import ROOT, SCRIPT, child_path


@contextlib.contextmanager
def another_process(take: Callable[[], object]) -> Iterator[int]:
    """A forked process that calls ``take()`` (takes a lock, saves a checkpoint), then waits;
    yields its pid while it waits, and lets it end (its locks go with it) afterwards."""
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            take()
            os.write(ready_w, b"1")
            os.read(go_r, 1)
        finally:
            os._exit(0)
    try:
        assert os.read(ready_r, 1) == b"1"
        yield pid
    finally:
        os.write(go_w, b"1")
        os.waitpid(pid, 0)


def test_a_new_run_folder_is_never_one_that_exists(tmp_path: Path) -> None:
    taken = tmp_path / "xtts_finetune-November-25-2026_01+43PM-0000000"
    taken.mkdir()
    (taken / "checkpoint_6.pth").write_bytes(b"the first run's")
    second = claim_new_folder(taken)
    third = claim_new_folder(taken)
    assert second.name == taken.name + "-2" and third.name == taken.name + "-3"
    assert second.is_dir() and third.is_dir() and not list(second.iterdir())
    assert (taken / "checkpoint_6.pth").read_bytes() == b"the first run's"


def test_a_folder_locked_by_another_process_is_refused_until_it_ends(tmp_path: Path) -> None:
    """The lock is the system's (flock): held by a live process it refuses, in one paragraph
    naming that process; the process gone, however it ended, it is free."""
    folder = tmp_path / "run"
    folder.mkdir()
    with another_process(lambda: lock_folder(folder)) as pid:
        with pytest.raises(RunFolderInUse) as info:
            lock_folder(folder)
        message = str(info.value)
        assert f"is in use by process {pid} on " in message and str(folder) in message
        assert "Nothing was written there" in message and len(message.splitlines()) == 1
    assert lock_folder(folder) == folder / LOCK_NAME  # its holder ended: free
    assert json.loads((folder / LOCK_NAME).read_text())["pid"] == os.getpid()


@pytest.mark.slow  # two child processes
def test_a_lock_beside_a_trainers_folder_refuses_alike_and_leaves_no_litter(
        tmp_path: Path) -> None:
    """``beside=True`` (the HF, Lightning and F5 integrations): the lock refuses a second
    process as in the folder, the trainer's folder holds nothing of ours, and a process that
    ends after its folder was removed (a temporary folder) removes the side folder too."""
    folder = tmp_path / "output_dir"
    folder.mkdir()
    with another_process(lambda: lock_folder(folder, beside=True)) as pid:
        with pytest.raises(RunFolderInUse, match=f"is in use by process {pid} on "):
            lock_folder(folder, beside=True)
    assert list(folder.iterdir()) == []
    assert (tmp_path / ".output_dir.training-patches" / LOCK_NAME).is_file()
    gone, kept = tmp_path / "gone", tmp_path / "kept"
    for each in (gone, kept):
        each.mkdir()
        subprocess.run([sys.executable, "-c",
                        "import shutil, sys; from patches._runlock import lock_folder; "
                        "lock_folder(sys.argv[1], beside=True); "
                        "sys.argv[2] == 'rm' and shutil.rmtree(sys.argv[1])",
                        str(each), "rm" if each is gone else "keep"], check=True,
                       env=dict(os.environ, PYTHONPATH=child_path(ROOT)), timeout=120)
    assert not (tmp_path / ".gone.training-patches").exists()
    assert (tmp_path / ".kept.training-patches" / LOCK_NAME).is_file()


@pytest.mark.xtts
def test_coqui_runs_started_in_the_same_minute_get_their_own_folders(tmp_path: Path,
                                                                     monkeypatch) -> None:
    """The coqui Trainer's folder name (``<run_name>-<month-day-year_hour+minute>-<commit>``)
    for two runs in one minute: two folders, each made as it is named."""
    pytest.importorskip("trainer")
    import datetime

    import trainer.generic_utils as generic
    import trainer.trainer

    import patches

    class Frozen(datetime.datetime):
        @classmethod
        def now(cls, tz=None):  # one minute for both runs
            return cls(2026, 11, 25, 13, 43)

    monkeypatch.setattr(generic.datetime, "datetime", Frozen)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    patches.advanced.apply(["checkpoint"])
    try:
        first = trainer.trainer.get_experiment_folder_path(tmp_path, "xtts_finetune")
        second = trainer.trainer.get_experiment_folder_path(tmp_path, "xtts_finetune")
    finally:
        patches.revert()
    assert first != second and first.is_dir() and second.is_dir()
    assert second.name == first.name + "-2"
    # Control: upstream's own function names one folder for both.
    assert generic.get_experiment_folder_path(tmp_path, "x") == \
        generic.get_experiment_folder_path(tmp_path, "x")


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=child_path(ROOT))
    return forkserver.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=900)


@pytest.mark.xtts
@pytest.mark.slow
def test_two_headless_runs_into_one_output_folder_never_share_a_run_folder(
        tmp_path: Path) -> None:
    """A run trains in ``out``; a second ``--resume auto`` of it is refused (exit 2, one
    paragraph, nothing of the first run changed); a second new run gets its own run
    folder; ``report`` finds two runs."""
    pytest.importorskip("TTS")
    from processes import start_headless, tiny_run, wait_for_text

    out, common = tiny_run(tmp_path, "--save-step", "2")
    first = start_headless(*common, "--epochs", "50", cwd=tmp_path)
    try:
        # printed in the step after the one that saved checkpoint_2.pth
        wait_for_text(out / "train.log", "GLOBAL_STEP: 3", first)
        # paused while the other two start (alive, its run folder held): on 2 cores its
        # training would only slow them down
        os.killpg(first.pid, signal.SIGSTOP)
        (folder,) = list(out.glob("xtts_finetune-*"))
        config = (folder / "config.json").read_bytes()
        resumed = _run(*common, "--epochs", "1", "--resume", "auto", cwd=tmp_path)
        assert resumed.returncode == 2, resumed.stderr[-3000:]
        said = [line for line in resumed.stderr.splitlines() if "error:" in line]
        assert len(said) == 1 and "Traceback" not in resumed.stderr, resumed.stderr[-3000:]
        assert said[0] == resumed.stderr.strip().splitlines()[-1]  # the one paragraph, last
        assert f"the run folder {folder} is in use by process {first.pid}" in said[0]
        assert (folder / "config.json").read_bytes() == config
        second = _run(*common, "--epochs", "1", cwd=tmp_path)  # a new run beside it
        assert second.returncode == 0, second.stderr[-3000:]
        assert first.poll() is None  # the first run is alive, undisturbed
        os.killpg(first.pid, signal.SIGCONT)
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=600)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert first.returncode == 143
    folders = sorted(out.glob("xtts_finetune-*"))
    assert len(folders) == 2 and all(list(f.glob("checkpoint_*.pth")) for f in folders)
    report = forkserver.run([sys.executable, "-m", "patches", "report", str(out), "--json", "-",
                             "--no-picture"], capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=child_path(ROOT)))
    runs = json.loads(report.stdout)["runs"]
    assert sorted(r["folder"] for r in runs) == [str(f) for f in folders]
    verdicts = {Path(r["folder"]): r["verdict"] for r in runs}
    assert verdicts[folder] == "interrupted" and "interrupted" not in [
        v for f, v in verdicts.items() if f != folder]


def test_two_plain_loops_never_save_into_one_checkpoint_folder(tmp_path: Path) -> None:
    """Issue 26 item 3 for a plain loop: a second process whose CheckpointManager saves into
    a folder another live run saves into gets one paragraph before it writes anything (it
    would prune, replace and resume the first run's checkpoints); the first run's files are
    as they were; reading the folder (resume) needs no lock; the holder gone, it is free."""
    import torch

    from patches import CheckpointError, CheckpointManager

    folder = tmp_path / "ckpts"
    with another_process(lambda: CheckpointManager(folder).save(5, torch.nn.Linear(2, 2))) \
            as pid:
        before = {p.name: p.read_bytes() for p in folder.iterdir()}
        second = CheckpointManager(folder)
        assert second.resume("auto") == folder / "ckpt_000000005.pt"  # reading is free
        with pytest.raises(CheckpointError) as info:
            second.save(1, torch.nn.Linear(2, 2))
        message = str(info.value)
        assert f"checkpoint folder {folder} is in use by process {pid} on " in message
        assert "Nothing was written there" in message and len(message.splitlines()) == 1
        assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert second.save(6, torch.nn.Linear(2, 2)).is_file()  # its holder ended: free
