"""Real write faults for tests: a small full disk, a read-only folder (tmpfs mounts; the
test is skipped where mounting is refused) and a file-size limit (``ulimit -f``, in a
subprocess, SIGXFSZ ignored so that the write fails with EFBIG as Python makes it)."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator, Sequence

import pytest
from processes import child_path

ROOT = Path(__file__).resolve().parents[1]


def _mount(folder: Path, options: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode})")


def _umount(folder: Path) -> None:
    subprocess.run(["umount", "-l", str(folder)], capture_output=True)


@contextlib.contextmanager
def full_disk(folder: Path, *, size: str = "64k", free: int = 2048) -> Iterator[Path]:
    """``folder`` on its own tmpfs of ``size``, filled until about ``free`` bytes are left
    (the filler file is ``folder/filler``)."""
    _mount(folder, f"size={size}")
    try:
        filler = folder / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:  # full
            pass
        finally:
            os.close(fd)
        stats = os.statvfs(folder)
        room = stats.f_bavail * stats.f_frsize
        if room < free:  # leave a little: a small file still fits, a large one does not
            with open(filler, "r+b") as handle:
                handle.truncate(max(0, filler.stat().st_size - (free - room)))
        yield folder
    finally:
        _umount(folder)


@contextlib.contextmanager
def read_only(folder: Path, files: dict[str, bytes] | None = None) -> Iterator[Path]:
    """``folder`` as a read-only tmpfs holding ``files`` (written before it goes read-only).
    Root writes through permission bits: only a read-only mount refuses it."""
    _mount(folder, "size=1m")
    try:
        for name, data in (files or {}).items():
            (folder / name).write_bytes(data)
        done = subprocess.run(["mount", "-o", "remount,ro", str(folder)], capture_output=True,
                              text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot remount a tmpfs read-only here ({done.stderr.strip()})")
        yield folder
    finally:
        _umount(folder)


def run_with_file_limit(argv: Sequence[str], limit: int, *, cwd: Path,
                        timeout: float = 600) -> subprocess.CompletedProcess:
    """``python argv...`` with RLIMIT_FSIZE ``limit`` bytes (``ulimit -f``) and SIGXFSZ
    ignored: a write past the limit fails with EFBIG instead of killing the process."""
    def limited() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    env = dict(os.environ, PYTHONPATH=child_path(ROOT), OMP_NUM_THREADS="1",
               PYTHONDONTWRITEBYTECODE="1", TRAINING_PATCHES_QUIET="1")
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, preexec_fn=limited)


def one_paragraph(err: str) -> None:
    """stderr holds one paragraph (one line) and no traceback."""
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def temporaries(folder: Path) -> list[str]:
    """Temporary files of an atomic write left in ``folder``."""
    return [p.name for p in folder.iterdir() if ".tp-tmp-" in p.name]
