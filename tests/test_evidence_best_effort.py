"""Evidence is best effort: a record that cannot be written never raises into training.

A full disk (a small tmpfs filled up), a file-size limit (``RLIMIT_FSIZE`` in a
subprocess, SIGXFSZ ignored as Python does) and a folder that cannot be written (its
parent is a file; a read-only tmpfs) each give one WARNING naming the file and the
error; the record waits in memory, is written once the file can be written again, and
``patches.stats()["evidence"]`` counts what is not written. Training's parameters are
those of the same run with a writable folder. tmpfs cases skip where mounting is not
permitted.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Iterator

import pytest
import torch

import patches
from patches import _run, dataset_guard, oom_guard
from processes import child_path

ROOT = Path(__file__).resolve().parents[1]
EVENTS = "nonfinite_events.jsonl"
LEARNING = "learning_health.jsonl"


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(_run, "_dir_providers", [])
    yield


def _mount_tmpfs(folder: Path, *options: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(("size=64k", *options)),
                               "tmpfs", str(folder)], capture_output=True, text=True)
    except OSError as exc:
        pytest.skip(f"cannot run mount here ({exc})")
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {done.stderr.strip()}")


def _umount(folder: Path) -> None:
    subprocess.run(["umount", "-l", str(folder)], capture_output=True)


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs filled to the last byte (the file ``fill`` holds it)."""
    folder = tmp_path / "full"
    _mount_tmpfs(folder)
    try:
        fd = os.open(folder / "fill", os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, b"\0" * 512):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        yield folder
    finally:
        _umount(folder)


@pytest.fixture
def read_only_disk(tmp_path: Path) -> Iterator[Path]:
    folder = tmp_path / "ro"
    _mount_tmpfs(folder, "ro")
    try:
        yield folder
    finally:
        _umount(folder)


def _train(steps: int = 6, nan_at: tuple[int, ...] = (2, 4)) -> list[torch.Tensor]:
    """A plain loop with AdamW; the losses of ``nan_at`` are NaN. Returns the parameters."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randn(steps, 5, 4)
    for step in range(1, steps + 1):
        opt.zero_grad()
        loss = model(data[step - 1]).pow(2).mean()
        (loss * math.nan if step in nan_at else loss).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _warnings(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and text in r.getMessage()]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_a_full_disk_never_stops_training_and_the_records_come_later(
        full_disk: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    patches.advanced.apply()
    _run.set_output_dir(tmp_path / "fine")
    expected = _train()
    patches.advanced.reset_runtime_state()

    caplog.set_level(logging.WARNING, logger="training_patches")
    caplog.clear()
    _run.set_output_dir(full_disk)
    params = _train()  # raised OSError from inside optimizer.step() before
    assert all(torch.equal(a, b) for a, b in zip(params, expected))
    assert patches.stats()["nan_guard"]["skipped"] == 2
    events = full_disk / EVENTS
    (warning,) = _warnings(caplog, "could not write")
    assert f"could not write to {events} (OSError: [Errno 28] No space left on device)" \
        in warning
    assert "training goes on" in warning
    assert patches.stats()["evidence"] == {"written": 0, "waiting": 2, "lost": 0,
                                           "write_failures": 2}
    assert "NOT yet recorded in" in _warnings(caplog, "optimizer step 4 skipped")[0]
    assert not events.exists() or events.read_text() == ""

    (full_disk / "fill").unlink()  # space again: the next record brings the others along
    oom_guard.on_oom(RuntimeError("CUDA out of memory"), {"filenames": ["a.wav"]}, [])
    assert [e["step"] for e in _lines(events)] == [2, 4]
    assert _lines(full_disk / "oom_events.jsonl")[0]["samples"] == ["a.wav"]
    assert patches.stats()["evidence"] == {"written": 3, "waiting": 0, "lost": 0,
                                           "write_failures": 2}
    assert _warnings(caplog, "can be written again: the 2 record(s) that waited")


def test_an_fp16_overflow_on_a_full_disk_backs_off_as_torch_does(
        full_disk: Path, caplog: pytest.LogCaptureFixture) -> None:
    """scaler.update() raised OSError on the first overflow before."""
    patches.advanced.apply()
    caplog.set_level(logging.WARNING, logger="training_patches")
    _run.set_output_dir(full_disk)
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale((param * math.inf).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 512.0 and torch.equal(param.detach(), torch.ones(3))
    (warning,) = _warnings(caplog, "could not write")
    assert str(full_disk / "loss_scale.jsonl") in warning and "[Errno 28]" in warning
    assert patches.stats()["evidence"]["waiting"] == 1


def test_a_folder_whose_parent_is_a_file_gives_one_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "afile").write_text("not a folder")
    folder = tmp_path / "afile" / "reports"
    patches.advanced.apply()
    caplog.set_level(logging.WARNING, logger="training_patches")
    _run.set_output_dir(folder)
    _train(nan_at=(2, 3, 5))
    (warning,) = _warnings(caplog, "could not write")
    assert f"could not write to {folder / EVENTS} (NotADirectoryError: [Errno 20]" in warning
    assert patches.stats()["evidence"]["waiting"] == 3


def test_a_read_only_folder_gives_one_warning(read_only_disk: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    patches.advanced.apply()
    caplog.set_level(logging.WARNING, logger="training_patches")
    _run.set_output_dir(read_only_disk)
    _train()
    (warning,) = _warnings(caplog, "could not write")
    assert f"{read_only_disk / EVENTS} (OSError: [Errno 30] Read-only file system)" in warning


def test_dropped_samples_and_oom_batches_on_an_unwritable_folder(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "afile").write_text("")
    _run.set_output_dir(tmp_path / "afile" / "x")
    caplog.set_level(logging.WARNING, logger="training_patches")
    path = dataset_guard.report_path()
    key = dataset_guard.sample_key("train", {"audio_file": "a.wav"})
    assert dataset_guard.record_drop(path, key, {"reason": "decode_failure"}) is True
    oom_guard.on_oom(RuntimeError("CUDA out of memory"), {"filenames": ["b.wav"]}, [])
    assert len(_warnings(caplog, "could not write")) == 2  # one per file
    assert patches.stats()["evidence"]["waiting"] == 2


def test_what_is_still_unwritten_at_a_reset_is_logged_with_its_records(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "afile").write_text("")
    _run.set_output_dir(tmp_path / "afile" / "x")
    caplog.set_level(logging.WARNING, logger="training_patches")
    _run.append_jsonl(EVENTS, {"step": 7, "marker": "kept-in-the-log"})
    patches.advanced.reset_runtime_state()
    (lost,) = _warnings(caplog, "are lost from that file")
    assert "1 record(s) could not be written" in lost and '"marker": "kept-in-the-log"' in lost


_SIZE_LIMIT = r"""
import json, math, os, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
import torch, patches
from patches import _run
patches.advanced.apply()
_run.set_output_dir(sys.argv[1])
_run.append_jsonl("nonfinite_events.jsonl", {"step": 0, "pad": "x" * 100})
size = os.path.getsize(os.path.join(sys.argv[1], "nonfinite_events.jsonl"))
resource.setrlimit(resource.RLIMIT_FSIZE, (size + 60, size + 60))  # half a record more
torch.manual_seed(0)
model = torch.nn.Linear(3, 2)
opt = torch.optim.AdamW(model.parameters(), lr=0.1)
for step in range(1, 5):
    opt.zero_grad()
    loss = model(torch.ones(2, 3)).sum()
    (loss * math.nan if step in (2, 3) else loss).backward()
    opt.step()
print(json.dumps({"stats": patches.stats()["evidence"],
                  "skipped": patches.stats()["nan_guard"]["skipped"],
                  "weight": model.weight.tolist()}))
"""


@pytest.mark.slow
def test_a_file_size_limit_never_stops_training_nor_leaves_half_a_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINING_PATCHES_")}
    env["PYTHONPATH"] = child_path(ROOT)
    env[_run.RUN_ID_ENV] = uuid.uuid4().hex
    done = subprocess.run([sys.executable, "-c", _SIZE_LIMIT, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["skipped"] == 2
    assert result["stats"] == {"written": 1, "waiting": 2, "lost": 0, "write_failures": 2}
    assert done.stderr.count("could not write to") == 1
    assert (f"could not write to {tmp_path / EVENTS} (OSError: [Errno 27] File too large)"
            in done.stderr)
    assert "2 record(s) could not be written" in done.stderr  # at exit, with the records
    assert [e["step"] for e in _lines(tmp_path / EVENTS)] == [0]  # no half line after it


def _coqui_run(tiny_xtts, run: Path, output_dir: Path) -> tuple[list[torch.Tensor], int]:
    from test_nan_guard_coqui import poison_batch

    patches.advanced.reset_runtime_state()
    _run.set_output_dir(output_dir)
    config = tiny_xtts.make_config(run, epochs=1)
    torch.manual_seed(0)
    model = tiny_xtts.make_model(config)
    calls = poison_batch(model, 3)
    tiny_xtts.train(config, model)
    return [p.detach().clone() for p in model.parameters()], calls[0]


@pytest.mark.xtts
@pytest.mark.slow
@pytest.mark.parametrize("fault,errno_text", [("full_disk", "[Errno 28]"),
                                              ("read_only_disk", "[Errno 30]")])
def test_the_coqui_trainer_on_a_full_disk_trains_as_with_a_writable_folder(
        tiny_xtts, fault: str, errno_text: str, tmp_path: Path,
        request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture) -> None:
    """The coqui Trainer whose report folder is full, or read-only: the same parameters as
    with a writable one, the bad step skipped, one WARNING naming the file and the error."""
    patches.advanced.apply()
    expected, batches = _coqui_run(tiny_xtts, tmp_path / "run_a", tmp_path / "fine")
    assert batches == 8  # 7 batches, the bad one replayed once to find its source
    folder = request.getfixturevalue(fault)
    caplog.set_level(logging.WARNING, logger="training_patches")
    caplog.clear()
    params, batches = _coqui_run(tiny_xtts, tmp_path / "run_b", folder)
    assert batches == 8  # the whole epoch ran after the bad batch
    assert all(torch.equal(a, b) for a, b in zip(params, expected))
    assert patches.stats()["nan_guard"]["skipped"] == 1
    # one WARNING per file: the bad step's event, and learning's note that this run (no
    # evaluations) has no reading gap measured
    said = _warnings(caplog, "could not write")
    files = [w.split("could not write to ", 1)[1].split(" (OSError", 1)[0] for w in said]
    assert sorted(files) == sorted({str(folder / EVENTS), str(folder / LEARNING)})
    assert all(f"(OSError: {errno_text}" in w for w in said)
    assert patches.stats()["evidence"]["waiting"] == 2
