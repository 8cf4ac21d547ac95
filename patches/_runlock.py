"""One run, one folder: a run folder is claimed by one process at a time.

- :func:`claim_new_folder`: a new run folder that no other run has, created at once
  (``os.mkdir`` fails when the name is taken, so two runs started together never get the
  same one): the name asked for, else ``<name>-2``, ``<name>-3``, ...
- :func:`lock_folder`: an exclusive lock on ``<folder>/.training-patches.lock``
  (``fcntl.flock``), held until the process ends: the system lets go of it when the
  process dies, however it dies, so a killed run never leaves a stale lock. A second
  process asking for the same folder gets :class:`RunFolderInUse`, one paragraph naming
  the process that holds it.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # Windows: no flock; folders are still claimed by mkdir
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".training-patches.lock"

# The locks this process holds: folder -> its open lock file (closing it would let go).
_held: dict[str, int] = {}


class RunFolderInUse(RuntimeError):
    """Another process is training in this run folder; nothing was written there."""


def claim_new_folder(path: str | os.PathLike[str]) -> Path:
    """``path`` created now if no folder is there, else the first free ``<path>-N`` (N = 2,
    3, ...), created now. Its parent is created when missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for number in range(1, 10_000):
        candidate = path if number == 1 else path.with_name(f"{path.name}-{number}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        return candidate
    raise RunFolderInUse(f"training-patches: {path} and 9,999 numbered folders beside it "
                         f"exist; give the run another name or folder.")


def _holder(lock: Path) -> str:
    try:
        found: Any = json.loads(lock.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        found = None
    if not isinstance(found, dict):
        return "another process"
    return (f"process {found.get('pid', '?')} on {found.get('host', '?')} (since "
            f"{found.get('started', '?')})")


def lock_folder(folder: str | os.PathLike[str], *, what: str = "run folder",
                overwritten: str = "checkpoints and config.json") -> Path:
    """Lock ``folder`` for this process (again: nothing to do); returns the lock file.

    Raises :class:`RunFolderInUse` when another process holds it. Where the system has no
    ``flock`` (Windows, some network mounts) or the lock file cannot be made (a read-only
    folder), nothing is locked."""
    if fcntl is None:
        return Path(folder) / LOCK_NAME
    folder = Path(folder)
    key = os.path.realpath(folder)
    lock = folder / LOCK_NAME
    if key in _held:
        return lock
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:  # a read-only or full folder: nothing to lock; the run's own writes say so
        return lock
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunFolderInUse(
            f"training-patches: the {what} {folder} is in use by {_holder(lock)}: two runs "
            f"in one folder would overwrite each other's {overwritten}. Nothing was written "
            f"there. Wait for that run to end (or stop it), or give this run a folder of its "
            f"own.") from None
    except OSError:  # a file system without flock (some network mounts): not locked
        os.close(fd)
        return lock
    try:  # who holds it, for the next one's message; a full disk leaves it unsaid
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).encode())
    except OSError:
        pass
    _held[key] = fd
    return lock


def holds(folder: str | os.PathLike[str]) -> bool:
    """Whether this process holds the lock of ``folder``."""
    return os.path.realpath(folder) in _held


__all__ = ["LOCK_NAME", "RunFolderInUse", "claim_new_folder", "lock_folder", "holds"]
