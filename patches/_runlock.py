"""One run, one folder: a run folder is claimed by one process at a time.

:func:`claim_new_folder` makes a folder no other run has (``<name>``, ``<name>-2``, ...);
:func:`lock_folder` holds an ``fcntl.flock`` until the process ends (no stale lock), a second
process getting :class:`RunFolderInUse`; :func:`side_folder` beside a folder another trainer
owns holds the lock and the run records, so that its folder holds only what it wrote.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # Windows: no flock; folders are still claimed by mkdir
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".training-patches.lock"
SIDE_SUFFIX = ".training-patches"

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


def side_folder(folder: str | os.PathLike[str]) -> Path:
    """``.<name>.training-patches`` beside ``folder`` (not created here)."""
    folder = Path(os.path.abspath(folder))
    return folder.parent / f".{folder.name}{SIDE_SUFFIX}"


def is_side_folder(name: str) -> bool:
    """Whether a folder's name is a :func:`side_folder`'s."""
    return name.startswith(".") and name.endswith(SIDE_SUFFIX) and len(name) > len(SIDE_SUFFIX) + 1


def _drop_orphan_sides() -> None:
    """At exit: the side folders of folders that are gone (a removed temporary folder)
    would only be litter beside them."""
    for key in list(_sides):
        if not os.path.isdir(key):
            shutil.rmtree(_sides.pop(key), ignore_errors=True)


_sides: dict[str, Path] = {}  # folder -> the side folder this process made use of


def ensure_side_folder(folder: str | os.PathLike[str]) -> Path:
    """:func:`side_folder` of ``folder``, created when missing (best effort); removed at
    this process's exit if ``folder`` is gone by then."""
    side = side_folder(folder)
    try:
        side.mkdir(exist_ok=True)
    except OSError:
        pass  # a read-only parent: the writes into it say so, best effort
    if not _sides:
        atexit.register(_drop_orphan_sides)
    _sides[os.path.abspath(folder)] = side
    return side


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
                overwritten: str = "checkpoints and config.json", beside: bool = False) -> Path:
    """Lock ``folder`` for this process; returns the lock file (in ``folder``, or with
    ``beside`` in its :func:`side_folder`). :class:`RunFolderInUse` when another process holds
    it; nothing is locked where there is no ``flock`` or the lock file cannot be made."""
    lock = (ensure_side_folder(folder) if beside else Path(folder)) / LOCK_NAME
    if fcntl is None:
        return lock
    folder = Path(folder)
    key = os.path.realpath(folder)
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


__all__ = ["LOCK_NAME", "RunFolderInUse", "claim_new_folder", "ensure_side_folder",
           "holds", "is_side_folder", "lock_folder", "side_folder"]
